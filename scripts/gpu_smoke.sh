#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: synchronised timing, CUDA peak statistics, the need_weights
# comparison on a CUDA kernel, cached decoding, and the check battery on the device.
#   bash scripts/gpu_smoke.sh [OUT_DIR]      (exit 0 when every assertion holds; JSON results in OUT_DIR)
set -euo pipefail
out="${1:-gpu-smoke}"
mkdir -p "$out"
python - "$out" <<'PY'
import json, sys
import torch
import tblock_cli
from tblock_cli.benchmark.profiling import profile_call

out = sys.argv[1]
assert torch.cuda.is_available(), "no CUDA device"
dev = torch.device("cuda")
print("device:", torch.cuda.get_device_name(dev), "| torch", torch.__version__)

# 1. CUDA peak statistics on a known allocation: 64 MiB, nothing else
p = profile_call(lambda: torch.empty(64 * 2**20, dtype=torch.uint8, device=dev), dev)
assert p.peak_bytes == 64 * 2**20, p
print("known allocation peak:", p.peak_bytes, "bytes via", p.source)

# 2. synchronised timing: a 4096^3 matmul measured by tblock's sampler against CUDA events
from tblock_cli.benchmark.timing import time_samples
a = torch.randn(4096, 4096, device=dev)
lat = time_samples(lambda: a @ a, dev, 0.5)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); [a @ a for _ in range(20)]; end.record(); torch.cuda.synchronize()
events_ms = start.elapsed_time(end) / 20
print(f"matmul: tblock median {lat.median * 1e3:.3f} ms, CUDA events {events_ms:.3f} ms")
assert abs(lat.median * 1e3 - events_ms) / events_ms < 0.25, "timing disagrees with CUDA events"

# 3. need_weights on and off on a CUDA attention kernel, train mode, no dropout
r = tblock_cli.bench(d_model=1024, n_heads=16, batch=8, seq=[2048], mode="train", need_weights=True, dropout=0.0,
                     device="cuda", min_time=1.0)
off, on = r.pair("train", 2048)
matrix = 8 * 16 * 2048 * 2048 * 4
print(f"train seq 2048: off {off.latency.median*1e3:.2f} ms {off.peak_bytes/2**20:.1f} MiB [{off.attention_kernel}] | "
      f"on {on.latency.median*1e3:.2f} ms {on.peak_bytes/2**20:.1f} MiB [{on.attention_kernel}]")
assert not off.materialises and on.materialises, (off.attention_kernel, on.attention_kernel)
assert on.peak_bytes - off.peak_bytes >= matrix, "need_weights=False should save at least one (B, H, L, L) matrix"
json.dump(r.to_dict(), open(f"{out}/need_weights.json", "w"), indent=2)

# 4. cached decoding on the device
d = tblock_cli.bench(d_model=1024, n_heads=16, batch=4, seq=[512], decode=256, device="cuda", min_time=0.2)
cached, full = d.decode_pair()
print(f"decode 256: cached {cached.latency.median*1e3:.3f} ms/token, recompute {full.latency.median*1e3:.3f} ms/token")
assert cached.cache_bytes == d.decode_analytic_bytes and cached.latency.median < full.latency.median
json.dump(d.to_dict(), open(f"{out}/decode.json", "w"), indent=2)

# 5. the battery on the device, causal, with its cache
c = tblock_cli.check(device="cuda", causal=True, d_model=512, n_heads=8)
print("check:", c.counts())
tblock_cli.assert_ok(c)
json.dump(c.to_dict(), open(f"{out}/check.json", "w"), indent=2)
print("GPU smoke: all assertions held")
PY

"""Where a block runs: device and dtype resolution, free memory, size estimates, environment."""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager

import torch

from tblock_cli.config import BlockConfig
from tblock_cli.errors import ConfigError, ResourceError, one_line

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
MiB = 1024**2


def resolve_device(spec: str) -> torch.device:
    """auto -> cuda when present (else mps, else cpu); refuse a device that is not there."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not _mps_available():
            raise ConfigError("--device mps: no MPS device on this machine; use --device cpu")
        return torch.device("mps")
    m = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if not m:
        raise ConfigError(f"--device must be auto, cpu, cuda, cuda:N or mps, got {spec!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {spec}: no CUDA device on this machine; use --device cpu")
    index = int(m.group(1)) if m.group(1) else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"--device {spec}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend and backend.is_available())


@contextmanager
def session(threads: int | None, module: torch.nn.Module | None = None):
    """torch's intra-op threads set for a while (None: untouched), and the module's training modes as they
    were: both restored after, however the run ends."""
    from tblock_cli.probes import kept_modes

    was = torch.get_num_threads()
    with ExitStack() as stack:
        if module is not None:
            stack.enter_context(kept_modes(module))
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            yield
        finally:
            torch.set_num_threads(was)


def placed(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every floating parameter and buffer is already of this device and dtype (moving would change nothing)."""
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device == device and t.dtype == dtype for t in tensors if t.is_floating_point())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for a name, after a tiny matmul + LayerNorm proves the device runs it."""
    if name not in DTYPES:
        raise ConfigError(f"--dtype must be one of float32, float16, bfloat16, got {name!r}")
    dtype = DTYPES[name]
    try:
        a = torch.ones(2, 4, device=device, dtype=dtype)
        torch.nn.functional.layer_norm(a @ a.T, (2,))
        torch.nn.functional.scaled_dot_product_attention(a[None], a[None], a[None])
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"--dtype {name} does not run on {device}: {one_line(e)}") from None
    return dtype


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors: cudaMemGetInfo on CUDA, MemAvailable on the host otherwise."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def estimate_bytes(cfg: BlockConfig, *, seq: int | None = None, train: bool = True, copies: int = 1) -> int:
    """A generous upper estimate of one forward (+ backward) of the built block, in bytes.

    Parameters (+ gradients), and per layer the saved activations: about 12 tensors of (B, T, d),
    two of (B, T, d_ff) and, on the paths that materialise it, two (B, H, T, T) attention matrices.
    `copies` counts extra copies of the parameters (the float64 reference of `check`).
    """
    item = DTYPES[cfg.dtype].itemsize
    T = seq if seq is not None else cfg.seq
    d, f, B, H = cfg.d_model, cfg.ffn_dim, cfg.batch, cfg.n_heads
    params = cfg.layers * (4 * d * d + 2 * d * f + 9 * d + f) + 2 * d
    acts = cfg.layers * B * T * (12 * d + 2 * f + 2 * H * T)
    factor = 2 if train else 1
    return params * item * factor + acts * item + params * 8 * copies


# check runs more than one forward + backward: a float64 copy and its forward (dtype), a dropout-free
# copy (train_eval), the traced forward whose intermediates are kept (dataflow), float64 attention
# scores for the statistics. Its peak RSS measured 1.22x (batch 4), 1.38x (batch 8) and 1.41x (batch 4, seq 1024) the one-pass
# estimate at d_model 1024, 4 layers, seq 512, above a 220 MiB process with torch imported. 2x plus the
# process keeps the gate an upper bound with room (`/usr/bin/time -f %M tblock check ...`).
CHECK_FACTOR = 2
PROCESS_BYTES = 300 * MiB


def check_estimate(cfg: BlockConfig) -> int:
    """An upper bound on the memory `tblock check` needs (see CHECK_FACTOR)."""
    return CHECK_FACTOR * estimate_bytes(cfg, copies=1) + PROCESS_BYTES


def ensure_fits(estimate: int, device: torch.device, what: str) -> None:
    """Refuse, before allocating, work estimated larger than the device's free memory."""
    free = free_bytes(device)
    if estimate > free:
        raise ResourceError(
            f"{what} needs an estimated {estimate / MiB:,.0f} MiB but {device} has {free / MiB:,.0f} MiB free; "
            f"reduce --batch, --seq, --d-model or --layers"
        )


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    env = {
        "torch": torch.__version__,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env

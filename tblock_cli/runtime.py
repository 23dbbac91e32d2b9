"""Where a block runs: device and dtype resolution, free memory, size estimates, environment."""

from __future__ import annotations

import re
import sys
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@contextmanager
def kept_rng():
    """torch's global random state (CPU, and every CUDA device already in use), Python's and NumPy's as the caller
    left them, after: tblock seeds weights, inputs and the streams a block draws from for repeatable runs, and must not
    re-seed the caller's streams."""
    import random
    import sys

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    py = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        if np_state is not None:
            np.random.set_state(np_state)


def placed(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every floating parameter and buffer is already of this device and dtype (moving would change nothing)."""
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device == device and t.dtype == dtype for t in tensors if t.is_floating_point())


def dtype_name(dtype: torch.dtype) -> str:
    """float32, bfloat16, ...: a dtype as the flags and the JSON name it."""
    return str(dtype).replace("torch.", "")


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


def block_params(cfg: BlockConfig) -> int:
    """Parameters of the built-in block of cfg's sizes (a user's or a Hugging Face block may differ: pass its count)."""
    d, f = cfg.d_model, cfg.ffn_dim
    return cfg.layers * (4 * d * d + 2 * d * f + 9 * d + f) + 2 * d


def activation_bytes(cfg: BlockConfig, seq: int | None = None) -> int:
    """Saved activations of one forward: per layer about 12 tensors of (B, T, d), two of (B, T, d_ff) and, on the
    paths that materialise it, two (B, H, T, T) attention matrices."""
    T = seq if seq is not None else cfg.seq
    d, f, B, H = cfg.d_model, cfg.ffn_dim, cfg.batch, cfg.n_heads
    return cfg.layers * B * T * (12 * d + 2 * f + 2 * H * T) * DTYPES[cfg.dtype].itemsize


def estimate_bytes(cfg: BlockConfig, *, seq: int | None = None, train: bool = True, copies: int = 1,
                   params: int | None = None) -> int:
    """A generous upper estimate of the tensors of one forward (+ backward) of the block, in bytes: parameters
    (+ gradients) and the saved activations. `copies` counts extra float64 copies of the parameters."""
    item = DTYPES[cfg.dtype].itemsize
    n = params if params is not None else block_params(cfg)
    factor = 2 if train else 1
    return n * item * factor + activation_bytes(cfg, seq) + n * 8 * copies


# The process before any block, as peak RSS: torch imported (299 MiB for `check --d-model 32`), and with
# transformers for an hf: block (371 MiB for `check --block hf:llama --d-model 64`); with margin.
PROCESS_BYTES = 320 * MiB
HF_PROCESS_BYTES = 400 * MiB
# check's peak RSS above the process: the weights and one more set (the training backward's gradients; the
# float64 reference is streamed one sublayer at a time, below that) and some allocator slack. Measured
# (peak RSS - process) / weight bytes: 1.6 and 1.96 for the built-in block at d_model 1024 and 2048,
# 2.29, 2.13 and 2.14 for hf:llama at 1024, 2048 and 4096 (docs/performance.md); 2.2 keeps an upper
# bound within 15 % of every point. Activations count twice (a forward's and a second input's or the
# float64 reference's); 2x covered the 1.22-1.41x measured at batch 4-8, seq 512-1024.
CHECK_WEIGHT_SETS = 2.2
CHECK_ACTIVATIONS = 2


def check_estimate(cfg: BlockConfig, params: int | None = None, hf: bool = False) -> int:
    """An upper bound on the peak RSS `tblock check` reaches (params: the block's count, when known)."""
    n = params if params is not None else block_params(cfg)
    item = max(DTYPES[cfg.dtype].itemsize, 4)  # the reference check compares in float32
    process = HF_PROCESS_BYTES if hf else PROCESS_BYTES
    return int(process + CHECK_WEIGHT_SETS * n * item + CHECK_ACTIVATIONS * activation_bytes(cfg))


# bench's peak RSS: a process of ~370 MiB (the profiler, rich), parameters and gradients with slack, the
# activations of the path that keeps the attention matrix. Fitted on d_model 1024 and 2048 at seq 128
# (1.17x the weights and gradients) and d_model 512, batch 4, seq 1024 with need_weights on (1.6x the
# activations); these factors put each point 4-11 % under the estimate.
BENCH_PROCESS_BYTES = 400 * MiB
BENCH_WEIGHTS = 1.25
BENCH_ACTIVATIONS = 1.7


def bench_estimate(cfg: BlockConfig, *, seq: int, train: bool, params: int | None = None) -> int:
    """An upper bound on bench's peak RSS at one sweep point."""
    n = params if params is not None else block_params(cfg)
    weights = n * DTYPES[cfg.dtype].itemsize * (2 if train else 1)
    return int(BENCH_PROCESS_BYTES + BENCH_WEIGHTS * weights + BENCH_ACTIVATIONS * activation_bytes(cfg, seq))


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
        "dtype": dtype_name(dtype),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


@contextmanager
def meta_autocast():
    """`torch.autocast("meta", ...)` raises (meta has no autocast dtype). While a forward runs on the meta device (a
    second device every machine has), a block's own `torch.autocast(x.device.type, enabled=False)` (OLMo's rotary
    table, built in float32 whatever the run) is entered as the CPU's: meta tensors compute shapes only."""
    real = torch.autocast

    class Autocast(real):
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = Autocast
    try:
        yield
    finally:
        torch.autocast = real


class HandlerMode(TorchDispatchMode):
    """A dispatch mode that hands every aten call to handler(func, args, kwargs), which returns its result."""

    def __init__(self, handler: Callable):
        super().__init__()
        self.handler = handler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.handler(func, args, kwargs or {})


class _HandlerModeDynamoUnloaded(HandlerMode):
    """The same mode for a process that has not imported torch._dynamo: torch wraps a mode's own __torch_dispatch__
    in dynamo's disable, which imports it (1.7 s) at the first op. Compiled code in such a process is none, or starts
    under this mode (dynamo then traces the mode too: the same values, with recompilation warnings)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # defined again: an inherited one is wrapped
        return self.handler(func, args, kwargs or {})


def dispatch_mode(handler: Callable) -> TorchDispatchMode:
    """A mode calling handler(func, args, kwargs) at every aten op; where torch._dynamo is loaded (a compiled block),
    the one torch wraps so that dynamo leaves it alone, else one that does not import dynamo."""
    return (HandlerMode if "torch._dynamo" in sys.modules else _HandlerModeDynamoUnloaded)(handler)


def compiled_run_eagerly():
    """Compiled parts of a block (a torch.compile'd submodule or function) run eagerly inside: tblock probes what the
    block computes, and dynamo refuses the modes and hooks its probes wrap the forward in (a guard's NameError);
    `compare --compile` is what measures the compiled block. Nothing where dynamo was never imported (nothing was
    compiled), or where this torch has no stances (before 2.6)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if "torch._dynamo" not in sys.modules or set_stance is None:
        return nullcontext()
    return set_stance("force_eager")

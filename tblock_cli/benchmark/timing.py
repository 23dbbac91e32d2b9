"""Timing: samples of a unit of work, synchronised, batched when calls are short, kept raw; median and IQR derived."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.benchmark.profiling import CallProfile, profile_call

# torch.utils.benchmark warns when the IQR exceeds 10 % of the median; tblock flags the same.
NOISY_IQR = 0.10
# Contention (threads fighting for cores) shows as a slow tail: a median well above the fastest sample.
SLOW_TAIL = 1.5
# A median and an IQR need a few samples; calls faster than min_time / TARGET_SAMPLES are batched
# into one sample (number_per_sample), so a sample is long enough for the clock and the loop is cheap.
MIN_SAMPLES = 5
TARGET_SAMPLES = 20
# The profiled warm-up (peak memory, the kernel) is not timed, and a first call pays page faults and lazy
# kernel set-up: it measured 1.3-2x a timed call on a d 512, seq 1024 training step, so 5 samples left
# 27 % of bench's wall time outside them. Samples then continue until they took WARMUP_SHARE times the
# warm-up (timed >= 80 % of each point), never past MAX_SAMPLES for that reason alone.
WARMUP_SHARE = 4.0
MAX_SAMPLES = 4 * MIN_SAMPLES


@dataclass(frozen=True)
class Latency:
    samples: tuple[float, ...]  # seconds per call: each the mean of number_per_sample back-to-back calls
    number_per_sample: int = 1

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def quartiles(self) -> tuple[float, float]:
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def iqr(self) -> float:
        q1, q3 = self.quartiles()
        return q3 - q1

    @property
    def noisy(self) -> bool:
        return self.iqr > NOISY_IQR * self.median or self.median > SLOW_TAIL * min(self.samples)

    def differs_from(self, other: "Latency") -> bool:
        """True when the interquartile ranges do not overlap: a difference larger than the noise."""
        a1, a3 = self.quartiles()
        b1, b3 = other.quartiles()
        return a3 < b1 or b3 < a1



def step_fn(call: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor, mode: str) -> Callable[[], None]:
    """One unit of work: an inference forward, or a training forward + backward from grads = None."""
    if mode == "infer":
        def infer():
            with torch.inference_mode():
                call(x)
        return infer

    grad = torch.ones_like(x)
    if not any(p.requires_grad for p in module.parameters()):
        # Nothing to train: the backward a stack would still run through this block is the input's gradient.
        x = x.detach().requires_grad_(True)

    def train():
        module.zero_grad(set_to_none=True)  # the step starts where zero_grad(set_to_none=True) leaves a loop
        x.grad = None
        backward_from(call(x), grad)
    return train


def backward_from(y: torch.Tensor, grad: torch.Tensor) -> None:
    """y.backward(grad), straight to autograd's engine: torch.autograd.backward first checks grad's shape through
    torch.fx.experimental.symbolic_shapes, whose import brings sympy (~3.5 s on a process's first train step). The
    engine checks the shape itself ("invalid gradient at index 0")."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    if engine is None:  # pragma: no cover - a torch that moved it
        y.backward(grad)
        return
    # tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
    engine.run_backward((y,), (grad,), False, False, (), True, True)


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def time_samples(fn: Callable[[], None], device: torch.device, min_time: float, clock: list | None = None,
                 warmup: float = 0.0) -> Latency:
    """Timed calls until min_time and MIN_SAMPLES; calls shorter than min_time / TARGET_SAMPLES batched per sample.

    The caller has run fn once already (the warm-up, `warmup` seconds): samples go on until they took
    WARMUP_SHARE times as long, up to MAX_SAMPLES. `clock`, when given, accumulates the seconds spent
    inside timed samples.
    """
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    number = max(1, int(min_time / TARGET_SAMPLES / max(first, 1e-9)))
    samples = [first] if number == 1 else []
    spent = first
    share = WARMUP_SHARE * warmup

    def more() -> bool:
        return spent < min_time or len(samples) < MIN_SAMPLES or (spent < share and len(samples) < MAX_SAMPLES)

    while more():
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        dt = time.perf_counter() - t0
        samples.append(dt / number)
        spent += dt
    if clock is not None:
        clock.append(spent)
    return Latency(tuple(samples), number)


def measure(fn: Callable[[], None], device: torch.device, min_time: float, clock: list) -> tuple[Latency, CallProfile]:
    """The profiled warm-up (peak memory, operators), then the timed samples."""
    started = time.perf_counter()
    prof = profile_call(fn, device)
    return time_samples(fn, device, min_time, clock, warmup=time.perf_counter() - started), prof


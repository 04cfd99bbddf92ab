"""Time keeping for the training benchmark: the run's clock and deadlines, and the timing loop of one compiled
program (the bf16 GEMM ceiling is the kernels' one: benchmarks.kernels.bench.gemm_ceiling_tflops)."""

from __future__ import annotations

import statistics
import time

import jax


class Clock:
    """Seconds since the start of the run, and deadlines as fractions of its budget."""

    def __init__(self, budget_s: float, t0: float | None = None):
        self.t0 = t0 if t0 is not None else time.time()
        self.budget = budget_s

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def at(self, frac: float) -> float:
        return self.t0 + self.budget * frac


def time_calls(call, steps: int, warmup: int, seconds_left: float, pipelined: bool) -> dict:
    """Time `call()` (returns what to block on): the first call (includes one-time work), warmup - 1 more, then up to
    `steps` synchronised calls (fewer when the time left would not cover them; at least 2) and, if `pipelined`, as
    many again back to back with one sync at the end (host overhead hidden)."""
    t = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - t
    steps = max(2, int(min(steps, (seconds_left - 20) / max(first, 1e-3) / (2.5 if pipelined else 1.5))))
    for _ in range(max(0, warmup - 1)):
        jax.block_until_ready(call())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
    out = {"first_call_s": first, "step_times_s": times, "median_s": statistics.median(times), "steps_timed": steps}
    if pipelined:
        t = time.perf_counter()
        for _ in range(steps):
            last = call()
        jax.block_until_ready(last)
        out["pipelined_mean_s"] = (time.perf_counter() - t) / steps
    return out

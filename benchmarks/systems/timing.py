"""How every sweep times device work, and what it records about the device it ran on.

A measurement jits the function once, calls it `warmup` times (compile, autotune, caches), then takes the median
over `reps` samples of (`calls` back-to-back calls, then block_until_ready) / calls: back-to-back calls let the
asynchronous dispatch hide the host's launch cost, the median ignores a stray slow sample.
"""

from __future__ import annotations

import statistics
import time

import jax


def seconds_per_call(fn, *args, reps: int = 5, calls: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def calls_for(seconds_per_call_estimate: float, target_seconds: float, cap: int = 1000) -> int:
    """How many back-to-back calls fill one timing sample of about `target_seconds`."""
    return int(max(1, min(cap, target_seconds / max(seconds_per_call_estimate, 1e-9))))


def device_memory_bytes(device=None) -> int | None:
    """Bytes the runtime lets one device allocate (None where the backend does not say, e.g. the CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise (of various types) instead of returning None
        stats = {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def device_summary() -> dict:
    d = jax.devices()[0]
    return dict(platform=d.platform, device_kind=d.device_kind, device_count=jax.device_count(),
                process_count=jax.process_count(), local_device_count=jax.local_device_count(),
                memory_bytes=device_memory_bytes(d), jax_version=jax.__version__)

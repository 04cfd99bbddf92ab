"""Size ladders for sweeps: powers of two between two bounds, capped by what the device can hold."""

from __future__ import annotations

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def power_ladder(lo: int, hi: int, step: int = 2) -> list[int]:
    """lo, lo*step, ... up to and including hi (lo and hi need not be powers of step)."""
    if lo <= 0 or hi < lo or step < 2:
        raise ValueError(f"need 0 < lo <= hi and step >= 2, got lo={lo} hi={hi} step={step}")
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= step
    return out


def memory_cap(requested_max: int, device_bytes: int | None, buffers: float, fraction: float = 0.5) -> int:
    """Largest size such that `buffers` buffers of it use at most `fraction` of the device's memory."""
    if device_bytes is None:
        return requested_max
    return min(requested_max, int(fraction * device_bytes / buffers))


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"

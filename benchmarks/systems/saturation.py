"""Where a throughput curve stops growing: the bandwidth-saturation point of a collective (= the gradient bucket
size, spec section 13) and the FLOP size at which a GEMM reaches its ceiling (spec section 15).

Measured curves are noisy and sometimes dip at the largest sizes, so the curve is first smoothed with a running
median of three (removes one-point spikes and dips without moving the knee), the plateau is the smoothed maximum,
and the saturation point is the smallest x from which the smoothed curve never again falls below
fraction x plateau.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Saturation:
    x: float | None  # smallest x at and after which the curve stays >= fraction * plateau; None if never
    plateau: float  # the smoothed maximum
    fraction: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def median3(values) -> np.ndarray:
    """Running median over a window of three; each end takes the median of the nearest full window, so a lone
    spike or dip at or next to either end can neither set the plateau nor break it. Curves of fewer than five
    points are returned as they are: there the window would be most of the curve."""
    y = np.asarray(values, dtype=float)
    if len(y) < 5:
        return y.copy()
    inner = np.median(np.stack([y[:-2], y[1:-1], y[2:]]), axis=0)
    return np.concatenate([inner[:1], inner, inner[-1:]])


def saturation_point(xs, ys, fraction: float = 0.95) -> Saturation:
    """xs ascending (e.g. message bytes, GEMM FLOPs), ys the throughput at each."""
    xs = np.asarray(xs, dtype=float)
    if len(xs) == 0:
        raise ValueError("saturation_point needs at least one point")
    if np.any(np.diff(xs) <= 0):
        raise ValueError("xs must be strictly increasing")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    smooth = median3(ys)
    plateau = float(smooth.max())
    above = smooth >= fraction * plateau
    # the last index that is below the threshold; everything after it stays above
    below = np.flatnonzero(~above)
    first = 0 if len(below) == 0 else int(below[-1]) + 1
    x = float(xs[first]) if first < len(xs) else None
    return Saturation(x=x, plateau=plateau, fraction=fraction)


def fit_latency_bandwidth(sizes, seconds) -> tuple[float, float]:
    """Least-squares fit of t = latency + size / bandwidth (the alpha-beta model), weighting each point by 1/t so
    small and large messages count alike. Returns (latency seconds, bandwidth bytes/s)."""
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if len(s) < 2:
        raise ValueError("need at least two sizes to fit latency and bandwidth")
    w = 1.0 / t
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    bandwidth = float("inf") if inv_beta <= 0 else 1.0 / inv_beta
    return max(float(alpha), 0.0), bandwidth

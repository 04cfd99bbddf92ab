"""The depthwise causal convolution of CCA's compressed q|k channels, as the grouped convolution consumes it.

    depthwise_taps(xp [B, T + P, C], w1 [C, t0], b1 [C], t1, same_segment, impl) -> t1 arrays [B, T, C] (xp.dtype)
    y_j[:, t] = b1 + sum_i w1[:, i] * xp[:, t + P - s] * same_segment[s][:, t]   (s = (t1-1-j) + (t0-1-i), the mask
    only for s > 0), P = (t0-1) + (t1-1) the halo columns xp carries before t = 0; fp32 inside, rounded once.

y_j is what grouped tap j of `CCAProjection._convolve` reads (the depthwise output seen from output t at offset
t1-1-j). 'xla' is the jnp reference below; 'pallas' the kernels of pallas_kernels/cca_conv.py (forward: every tap
from one read of the halo'd tile; backward: d xp and the weight-gradient partial sums in one pass). Why a kernel:
on the H200 XLA's fusions of the reference's backward took 0.70 ms per 2 x 4096-token microbatch over the bench
preset's 8 layers, about 5x the bytes it must move at copy bandwidth (benchmarks/train_h200_profile_sources.json,
cca.py's _convolve in the backward), while the forward ran near that bound.
"""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32
IMPLS = ("xla", "pallas")


def halo(t0: int, t1: int) -> int:
    """Columns before t = 0 that the two convolutions read (P)."""
    return (t0 - 1) + (t1 - 1)


def tap_offset(j: int, i: int, t0: int, t1: int) -> int:
    """Columns back from output t that depthwise tap i feeding grouped tap j reads."""
    return (t1 - 1 - j) + (t0 - 1 - i)


def depthwise_taps_reference(xp, w1, b1, t1: int, same_segment=None):
    t0 = w1.shape[1]
    P = halo(t0, t1)
    T = xp.shape[1] - P
    xf, w1, b1 = xp.astype(F32), w1.astype(F32), b1.astype(F32)
    ys = []
    for j in range(t1):
        y = b1
        for i in range(t0):
            s = tap_offset(j, i, t0, t1)
            col = xf[:, P - s:P - s + T]
            if same_segment is not None and s:
                col = col * same_segment[s][..., None]
            y = y + col * w1[:, i]
        ys.append(y.astype(xp.dtype))
    return ys


def depthwise_taps(xp, w1, b1, t1: int, same_segment=None, impl: str = "xla"):
    if impl == "xla":
        return depthwise_taps_reference(xp, w1, b1, t1, same_segment)
    if impl == "pallas":
        from pallas_kernels.cca_conv import depthwise_taps as kernel
        return kernel(xp, w1, b1, t1, same_segment)
    raise ValueError(f"CCA convolution impl {impl!r} unknown (use one of {IMPLS})")

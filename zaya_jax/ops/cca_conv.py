"""CCA's query/key mixing: the two causal convolutions over time on the [q | k] channels and the q/k mean residual
paths, as `CCAProjection` (zaya_jax/model/cca.py) and the Hugging Face reference compute them.

    qk_mix(xp [B, T + P, C'], w1 [C, t0], b1 [C], w2 [G, d, d, t1], b2 [C], heads, same_segment, impl, zero_halo)
        -> [B, T, C]

C = G * d channels: `heads` query heads of d channels, then G - heads KV heads, the first C of xp's C' >= C (a fused
projection's output passes whole: the kernel reads the channels in place). xp carries P = (t0-1) + (t1-1) halo
columns before t = 0 (the previous chunk's projections), or with zero_halo only the T positions of a sequence start,
whose halo is zeros (the kernel reads them as zeros; nothing is concatenated). In xp's dtype:

    y_j[:, t] = b1 + sum_i w1[:, i] * xp[:, t + P - s] * same_segment[s][:, t]   (s = tap_offset(j, i); fp32, rounded)
    z[:, t, g] = b2[g] + sum_j (y_j[:, t, g] @ w2[g, :, :, j]^T)                    (each tap's GEMM rounded; fp32 sum)
    q_res[h] = (q_h + k_kv(h)) / 2,  k_res[kv] = mean of q_res over kv's query heads  (q, k = xp[:, P:])
    out = round(z) + [q_res | k_res]

y_j is the depthwise output that grouped tap j reads, seen from output t (same_segment[s] [B, T] zeroes columns of an
earlier document; None: no resets). Its bias is never masked: at a sequence start the grouped convolution sees the
depthwise bias, not zero, at t = -1, as in the reference. 'xla' is the jnp reference below; 'pallas' the kernels of
pallas_kernels/cca_conv.py (one forward kernel for the whole block). Why a kernel: XLA's fusions of this block
(cca.py's _convolve, its grouped GEMMs and the residual lines) move several times the bytes the block must move.
The kernels run the op faster than XLA, forward and backward, but still far from copy bandwidth: the backward's
two kernels have room (docs/experiments.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.cca_conv_taps import halo, tap_offset

F32 = jnp.float32
IMPLS = ("xla", "pallas")


def depthwise_taps_reference(xp, w1, b1, t1: int, same_segment=None):
    """[y_j for j < t1], each [B, T, C] in xp.dtype (see the module docstring)."""
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


def mean_residuals(q, k):
    """q_res [B, T, H, d] = (q + k of the query head's KV head) / 2 and k_res [B, T, KV, d], its mean over the
    query heads of each KV head (in q's dtype)."""
    B, T, H, d = q.shape
    KV = k.shape[2]
    q_res = (q + jnp.repeat(k, H // KV, axis=2)) * 0.5
    return q_res, q_res.reshape(B, T, KV, H // KV, d).mean(axis=3)


def qk_mix_reference(xp, w1, b1, w2, b2, heads: int, same_segment=None, zero_halo: bool = False):
    G, d, _, t1 = w2.shape
    xp = xp[..., :G * d]
    if zero_halo:
        xp = jnp.pad(xp, ((0, 0), (halo(w1.shape[1], t1), 0), (0, 0)))
    B, Tp, C = xp.shape
    T = Tp - halo(w1.shape[1], t1)
    dt = xp.dtype
    ys = depthwise_taps_reference(xp, w1, b1, t1, same_segment)
    z = b2.astype(F32).reshape(G, d)
    w2 = w2.astype(dt)
    for j, y in enumerate(ys):  # the GEMMs keep the compute dtype (fp32 accumulation), as compute_matmul
        z = z + jnp.einsum("btgi,goi->btgo", y.reshape(B, T, G, d), w2[..., j], preferred_element_type=dt).astype(F32)
    qk = xp[:, Tp - T:].reshape(B, T, G, d)
    q_res, k_res = mean_residuals(qk[:, :, :heads], qk[:, :, heads:])
    return (z.astype(dt) + jnp.concatenate([q_res, k_res], axis=2)).reshape(B, T, C)


def qk_mix(xp, w1, b1, w2, b2, heads: int, same_segment=None, impl: str = "xla", zero_halo: bool = False):
    if impl == "xla":
        return qk_mix_reference(xp, w1, b1, w2, b2, heads, same_segment, zero_halo)
    if impl == "pallas":
        from pallas_kernels.cca_conv import qk_mix as kernel
        return kernel(xp, w1, b1, w2, b2, heads, same_segment, zero_halo)
    raise ValueError(f"CCA convolution impl {impl!r} unknown (use one of {IMPLS})")


def qk_mix_cached(x, ring, slot, w1, b1, w2, b2, heads: int, impl: str = "xla"):
    """A chunk x [B, T, C'] at cache slots slot .. slot + T - 1 after the columns a cache's ring holds (ring
    [B, P + 1, C]: slot s's raw [q | k] columns at s % (P + 1), model/cca.py): (qk_mix of the P columns before the
    chunk and the chunk, the ring including the chunk, in ring's dtype). 'pallas' reads the ring and x where they are
    in one kernel and, for a single token, writes its column into the ring in place: around an ordered halo a decode
    step ran a concatenation and a slice, two kernels of their own (benchmarks/gpu_census.py)."""
    G, d, _, t1 = w2.shape
    n = halo(w1.shape[1], t1) + 1
    if ring.shape != (x.shape[0], n, G * d):
        raise ValueError(f"cca qk_mix: the cached ring must be [B, P + 1, C] = {(x.shape[0], n, G * d)}, got "
                         f"{ring.shape}")
    if impl == "pallas" and n > 1:
        from pallas_kernels.cca_conv import qk_mix_cached as kernel
        return kernel(x, ring, slot, w1, b1, w2, b2, heads)
    if impl not in IMPLS:
        raise ValueError(f"CCA convolution impl {impl!r} unknown (use one of {IMPLS})")
    T = x.shape[1]
    before = jnp.roll(ring, -(slot % n), axis=1)[:, 1:]  # slots slot - P .. slot - 1, oldest first
    xp = jnp.concatenate([before.astype(x.dtype), x[..., :G * d]], axis=1)
    out = qk_mix(xp, w1, b1, w2, b2, heads, impl=impl)
    last = xp[:, xp.shape[1] - n:]  # slots slot + T - n .. slot + T - 1, rolled to their ring positions
    return out, jnp.roll(last, (slot + T) % n, axis=1).astype(ring.dtype)

"""CCA's query/key normalisation and rotary embedding, as the Hugging Face ZAYA reference computes them:

    qk_norm_rope(qk [B, T, H + KV, d], temp [KV], cos, sin [B, T, r], heads, impl) -> q [B, T, H, d], k [B, T, KV, d]

Every head is L2-normalised to norm sqrt(d) in fp32 (the norm clamped at the dtype's eps), key heads times their
temperature, rounded to qk's dtype; then NeoX rotate-half RoPE on each head's first 2r channels, in qk's dtype:
[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]. cos / sin hold cos(position * inv_freq) once (`rope_tables`; the
reference's tables repeat them for both halves).

'xla' is the jnp reference below; 'pallas' one kernel reading each head once and writing it once
(pallas_kernels/qk_norm_rope.py), whose backward is the reference's (autodiff on the saved inputs): inference is what
the kernel is for, and a training step pays the reference's passes only in its backward. Why a kernel: XLA runs the
block as three fusions plus the rotation, each a pass over the [B, T, H + KV, d] activations (docs/experiments.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
IMPLS = ("xla", "pallas")


def rope_inv_freq(theta: float, rotary_dim: int):
    return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))


def rope_tables(positions, inv_freq, dtype):
    """cos, sin [B, T, r] in dtype of positions [B, T] times inv_freq [r]."""
    ang = positions.astype(F32)[..., None] * inv_freq
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on the first 2r channels of each head; x [B, T, N, d], cos / sin [B, T, r]."""
    r = cos.shape[-1]
    cos = jnp.concatenate([cos, cos], -1)[:, :, None, :]
    sin = jnp.concatenate([sin, sin], -1)[:, :, None, :]
    xr, xp = x[..., :2 * r], x[..., 2 * r:]
    x1, x2 = xr[..., :r], xr[..., r:]
    rotated = xr * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, xp], axis=-1)


def qk_norm(qk, temp, heads: int):
    """Both parts normalised as one array: one reduction over all heads."""
    dt = qk.dtype
    eps = float(jnp.finfo(dt).eps)
    scale = qk.shape[-1] ** 0.5
    xf = qk.astype(F32)
    # max(sqrt(ss), eps) written as sqrt(max(ss, eps^2)): same value, but a zero vector (a padded token) gets a
    # zero gradient instead of sqrt's NaN at 0
    n = jnp.sqrt(jnp.maximum(jnp.sum(xf * xf, axis=-1, keepdims=True), eps * eps))
    normed = xf * (scale / n)
    k = normed[:, :, heads:] * temp.astype(F32)[None, None, :, None]
    return normed[:, :, :heads].astype(dt), k.astype(dt)


def qk_norm_rope_reference(qk, temp, cos, sin, heads: int):
    q, k = qk_norm(qk, temp, heads)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def qk_norm_rope_kernel(qk, temp, cos, sin, heads: int):
    from pallas_kernels import qk_norm_rope as kernel
    if not kernel.supported(qk.shape[-1], cos.shape[-1]):
        return qk_norm_rope_reference(qk, temp, cos, sin, heads)
    return kernel.qk_norm_rope_forward(qk, temp, cos, sin, heads)


def _kernel_fwd(qk, temp, cos, sin, heads):
    return qk_norm_rope_kernel(qk, temp, cos, sin, heads), (qk, temp, cos, sin)


def _kernel_bwd(heads, res, cotangents):
    _, pullback = jax.vjp(functools.partial(qk_norm_rope_reference, heads=heads), *res)
    return pullback(cotangents)


qk_norm_rope_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def qk_norm_rope(qk, temp, cos, sin, heads: int, impl: str = "xla"):
    if impl == "xla":
        return qk_norm_rope_reference(qk, temp, cos, sin, heads)
    if impl == "pallas":
        return qk_norm_rope_kernel(qk, temp, cos, sin, heads)
    raise ValueError(f"QK norm impl {impl!r} unknown (use one of {IMPLS})")

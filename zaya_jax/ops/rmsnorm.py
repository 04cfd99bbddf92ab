"""RMSNorm and the fused "scaled residual merge + RMSNorm" of every ZAYA1 block.

Numerics (pinned by tests against the Hugging Face reference): statistics in fp32, eps inside the rsqrt,
normalised value times the weight, then cast to the compute dtype. The residual merge is
(branch + hs_bias) * hs_scale + (residual + res_bias) * res_scale, all in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x, weight, eps: float, out_dtype=None):
    out_dtype = out_dtype or x.dtype
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * (xf * inv)).astype(out_dtype)


def layer_norm_reference(x, weight, bias, eps: float, out_dtype=None):
    """LayerNorm with fp32 statistics (centred variance), for the kernels' parity tests and non-ZAYA configs."""
    out_dtype = out_dtype or x.dtype
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * ((xf - mean) * inv) + bias.astype(jnp.float32)).astype(out_dtype)


def residual_merge_reference(branch, residual, hs_scale, hs_bias, res_scale, res_bias):
    f32 = jnp.float32
    return ((branch.astype(f32) + hs_bias.astype(f32)) * hs_scale.astype(f32)
            + (residual.astype(f32) + res_bias.astype(f32)) * res_scale.astype(f32))


def merge_rms_norm_reference(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps: float,
                             out_dtype):
    """Returns (new fp32 residual, RMSNorm(new residual) in out_dtype)."""
    h = residual_merge_reference(branch, residual, hs_scale, hs_bias, res_scale, res_bias)
    return h, rms_norm_reference(h, norm_weight, eps, out_dtype)


def rms_norm(x, weight, eps: float, out_dtype=None, *, impl: str = "xla"):
    if impl == "xla":
        return rms_norm_reference(x, weight, eps, out_dtype)
    if impl == "pallas":
        from pallas_kernels import rmsnorm as k
        return k.rms_norm(x, weight, eps, out_dtype)
    raise ValueError(f"rms_norm: unknown impl {impl!r} (use 'xla' or 'pallas')")


def merge_rms_norm(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps: float, out_dtype,
                   *, impl: str = "xla"):
    if impl == "xla":
        return merge_rms_norm_reference(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps,
                                        out_dtype)
    if impl == "pallas":
        from pallas_kernels import rmsnorm as k
        return k.merge_rms_norm(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps,
                                out_dtype)
    raise ValueError(f"merge_rms_norm: unknown impl {impl!r} (use 'xla' or 'pallas')")


def layer_norm(x, weight, bias, eps: float, out_dtype=None, *, impl: str = "xla"):
    if impl == "xla":
        return layer_norm_reference(x, weight, bias, eps, out_dtype)
    if impl == "pallas":
        from pallas_kernels import rmsnorm as k
        return k.layer_norm(x, weight, bias, eps, out_dtype)
    raise ValueError(f"layer_norm: unknown impl {impl!r} (use 'xla' or 'pallas')")

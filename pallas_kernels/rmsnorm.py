"""Fused norms for ZAYA1 as Pallas kernels (Triton lowering on GPU, interpret mode on the CPU), with custom VJPs.

Same signatures and numerics as `zaya_jax.ops.rmsnorm` (the jnp references):
  rms_norm(x, weight, eps, out_dtype)                 -> weight * x * rsqrt(mean(x^2) + eps)
  merge_rms_norm(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps, out_dtype)
      -> (h fp32, rms_norm(h)) with h = (branch + hs_bias) * hs_scale + (residual + res_bias) * res_scale
  layer_norm(x, weight, bias, eps, out_dtype)         -> weight * (x - mean) * rsqrt(var + eps) + bias
Statistics are fp32; the forward saves the inverse std (and mean) so the backward needs one pass over the rows.
Inputs may have any leading shape; the last axis is normalised. Inside shard_map (check_vma) the kernels run on
inputs made varying over all their mesh axes, so each gradient is summed over the axes its primal is invariant over
(a replicated weight's gradient over the data-parallel axis), as autodiff does for ordinary primitives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _norm_kernels as kern
from pallas_kernels.vma import sum_to_type_of

F32 = jnp.float32


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _dtype(out_dtype, default):
    return jnp.dtype(out_dtype if out_dtype is not None else default)


# ------------------------------------------------------------------------------------------------------ RMSNorm
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms(x, w, eps, out_dtype):
    return kern.rms_forward(x, w, eps=eps, out_dtype=out_dtype)[0]


def _rms_fwd(x, w, eps, out_dtype):
    y, rstd = kern.rms_forward(x, w, eps=eps, out_dtype=out_dtype)
    return y, (x, w, rstd)


def _rms_bwd(eps, out_dtype, res, dy):
    x, w, rstd = res
    dx, dw = kern.rms_backward(x, dy, rstd, w)
    return sum_to_type_of(dx, x), sum_to_type_of(dw.astype(w.dtype), w)


_rms.defvjp(_rms_fwd, _rms_bwd)


def rms_norm(x, weight, eps: float, out_dtype=None):
    y = _rms(_rows(x), weight, float(eps), _dtype(out_dtype, x.dtype))
    return y.reshape(x.shape)


# ------------------------------------------------------------------------------- residual merge + RMSNorm
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _merge(branch, residual, hs, hb, rs, rb, w, eps, out_dtype):
    h, y, _ = kern.merge_forward(branch, residual, hs, hb, rs, rb, w, eps=eps, out_dtype=out_dtype)
    return h, y


def _merge_fwd(branch, residual, hs, hb, rs, rb, w, eps, out_dtype):
    h, y, rstd = kern.merge_forward(branch, residual, hs, hb, rs, rb, w, eps=eps, out_dtype=out_dtype)
    return (h, y), (branch, residual, hs, hb, rs, rb, w, rstd)


def _merge_bwd(eps, out_dtype, res, cotangents):
    branch, residual, hs, hb, rs, rb, w, rstd = res
    dh, dy = cotangents
    d_branch, d_resid, g_branch, g_resid, g_sum, g_w = kern.merge_backward(
        branch, residual, dh.astype(F32), dy, rstd, hs, hb, rs, rb, w)
    # h = (branch + hb) * hs + (residual + rb) * rs, so d hb = hs * sum(g) and d rb = rs * sum(g).
    d_hb = hs.astype(F32) * g_sum
    d_rb = rs.astype(F32) * g_sum
    grads = (d_branch, d_resid, g_branch.astype(hs.dtype), d_hb.astype(hb.dtype), g_resid.astype(rs.dtype),
             d_rb.astype(rb.dtype), g_w.astype(w.dtype))
    return tuple(sum_to_type_of(g, p) for g, p in zip(grads, (branch, residual, hs, hb, rs, rb, w)))


_merge.defvjp(_merge_fwd, _merge_bwd)


def merge_rms_norm(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps: float, out_dtype):
    """Returns (new fp32 residual, RMSNorm(new residual) in out_dtype)."""
    shape = jnp.broadcast_shapes(branch.shape, residual.shape)
    branch, residual = jnp.broadcast_to(branch, shape), jnp.broadcast_to(residual, shape)
    h, y = _merge(_rows(branch), _rows(residual), hs_scale, hs_bias, res_scale, res_bias, norm_weight, float(eps),
                  _dtype(out_dtype, F32))
    return h.reshape(shape), y.reshape(shape)


# ---------------------------------------------------------------------------------------------------- LayerNorm
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layer(x, w, b, eps, out_dtype):
    return kern.layer_forward(x, w, b, eps=eps, out_dtype=out_dtype)[0]


def _layer_fwd(x, w, b, eps, out_dtype):
    y, mean, rstd = kern.layer_forward(x, w, b, eps=eps, out_dtype=out_dtype)
    return y, (x, w, b, mean, rstd)


def _layer_bwd(eps, out_dtype, res, dy):
    x, w, b, mean, rstd = res
    dx, dw, db = kern.layer_backward(x, dy, mean, rstd, w)
    return sum_to_type_of(dx, x), sum_to_type_of(dw.astype(w.dtype), w), sum_to_type_of(db.astype(b.dtype), b)


_layer.defvjp(_layer_fwd, _layer_bwd)


def layer_norm(x, weight, bias, eps: float, out_dtype=None):
    y = _layer(_rows(x), weight, bias, float(eps), _dtype(out_dtype, x.dtype))
    return y.reshape(x.shape)

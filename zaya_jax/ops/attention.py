"""Causal GQA attention over CCA's compressed heads.

Shapes: q [B, T, H, d]; k, v [B, S, KV, d] with H % KV == 0 and query head h reading KV head h // (H // KV)
(contiguous groups, never materialising repeated K/V). A key s is visible to a query t when
kv_positions[s] <= q_positions[t], (optionally) q_positions[t] - kv_positions[s] < sliding_window, kv_valid[s]
(padding) and equal segment ids (packed documents). Softmax statistics are fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = float(jnp.finfo(jnp.float32).min)


def _positions(positions, batch: int, length: int):
    if positions is None:
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (batch, length))
    return jnp.broadcast_to(positions.astype(jnp.int32), (batch, length))


def attention_mask(q_positions, kv_positions, *, kv_valid=None, q_segment_ids=None, kv_segment_ids=None,
                   sliding_window: int | None = None):
    """[B, T, S] boolean visibility."""
    qp, kp = q_positions[:, :, None], kv_positions[:, None, :]
    mask = kp <= qp
    if sliding_window is not None:
        mask &= (qp - kp) < sliding_window
    if kv_valid is not None:
        mask &= kv_valid[:, None, :].astype(bool)
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def attention_reference(q, k, v, *, q_positions=None, kv_positions=None, kv_valid=None, q_segment_ids=None,
                        kv_segment_ids=None, sliding_window=None, scale=None, return_lse=False):
    B, T, H, d = q.shape
    S, KV = k.shape[1], k.shape[2]
    g = H // KV
    scale = d ** -0.5 if scale is None else scale
    qp, kp = _positions(q_positions, B, T), _positions(kv_positions, B, S)
    if q_segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    mask = attention_mask(qp, kp, kv_valid=kv_valid, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          sliding_window=sliding_window)
    qg = q.reshape(B, T, KV, g, d)
    # scores and the value product in the compute dtype (fp32 accumulation inside the GEMM, as HF's bf16
    # matmuls), so the backward GEMMs stay in it too; the softmax itself runs in fp32. A single query (a decode
    # step) drops the query axis from both products: the output is then [B, KV, g, d], already in [B, 1, H, d]
    # order, where the general product's [B, KV, g, T, d] needs a transpose (a kernel of its own in each step).
    if T == 1:
        s = jnp.einsum("bkgd,bskd->bkgs", qg[:, 0], k, preferred_element_type=q.dtype)[:, :, :, None]
    else:
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=q.dtype)
    s = s.astype(jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, _NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = (p / denom).astype(v.dtype)
    if T == 1:
        o = jnp.einsum("bkgs,bskd->bkgd", p[:, :, :, 0], v, preferred_element_type=q.dtype)
    else:
        o = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=q.dtype)
    o = o.reshape(B, T, H, d)
    if return_lse:
        lse = (m + jnp.log(denom))[..., 0]  # [B, KV, g, T]
        return o, lse.reshape(B, H, T)
    return o


def _cudnn(q, k, v, *, q_positions, kv_positions, kv_valid, q_segment_ids, kv_segment_ids, sliding_window, scale):
    if any(x is not None for x in (q_positions, kv_positions, kv_valid, q_segment_ids)):
        # cuDNN's fused path takes causal + lengths only; everything else goes through an explicit mask.
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        mask = attention_mask(_positions(q_positions, B, T), _positions(kv_positions, B, S), kv_valid=kv_valid,
                              q_segment_ids=q_segment_ids,
                              kv_segment_ids=kv_segment_ids if kv_segment_ids is not None else q_segment_ids,
                              sliding_window=sliding_window)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn")
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=window,
                                        implementation="cudnn")


def attention(q, k, v, *, impl: str = "xla", q_positions=None, kv_positions=None, kv_valid=None, q_segment_ids=None,
              kv_segment_ids=None, sliding_window=None, scale=None):
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, kv_valid=kv_valid, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, sliding_window=sliding_window, scale=scale)
    if impl == "xla":
        return attention_reference(q, k, v, **kw)
    if impl == "cudnn":
        return _cudnn(q, k, v, **kw)
    if impl == "pallas":
        from pallas_kernels import cca_attention
        return cca_attention.attention(q, k, v, **kw)
    raise ValueError(f"attention: unknown impl {impl!r} (use 'xla', 'pallas' or 'cudnn')")


def attention_with_lse(q, k, v, *, impl: str = "xla", q_positions=None, kv_positions=None, kv_valid=None,
                       q_segment_ids=None, kv_segment_ids=None, sliding_window=None, scale=None):
    """(o, lse [B, H, T]) for merging context-parallel chunks: o = sum_c exp(lse_c - lse) o_c; differentiable."""
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, kv_valid=kv_valid, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, sliding_window=sliding_window, scale=scale)
    if impl == "xla":
        return attention_reference(q, k, v, return_lse=True, **kw)
    if impl == "pallas":
        from pallas_kernels import cca_attention
        return cca_attention.attention_with_lse(q, k, v, **kw)
    raise ValueError(f"attention_with_lse: unknown impl {impl!r} (use 'xla' or 'pallas')")

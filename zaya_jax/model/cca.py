"""Compressed Convolutional Attention (CCA / CCGQA) exactly as the Hugging Face ZAYA reference computes it.

Order: (padding mask) -> q/k/v projections -> two causal convolutions over time on [q | k] channels with the q/k
mean residual paths added after -> value heads [current | previous-token] -> QK L2-norm to sqrt(d) with the
per-KV-head key temperature -> partial NeoX RoPE -> causal GQA attention -> o_proj.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.base import Linear, dtypes, normal_init
from zaya_jax.ops import attention as attention_ops
from zaya_jax.ops import cca_conv as conv_ops
from zaya_jax.ops import qk_norm_rope as qk_ops


@dataclasses.dataclass
class CCAState:
    """What a sequence chunk needs from before its start: the last `conv_halo` raw [q | k] projection columns
    [B, P, C] and the previous token's delayed-value projection [B, KV*d/2]. Zeros/None = sequence start.

    With `slot` ([] int32, the chunk's first cache slot) conv is a ring indexed by cache slot instead, as a decode
    cache holds it: [B, P + 1, C], the columns of the last P + 1 slots, slot s at s % (P + 1). A single token's step
    then writes one column in place, where an ordered halo is concatenated and sliced again at every token."""

    conv: jax.Array | None = None
    value: jax.Array | None = None
    slot: jax.Array | None = None


jax.tree_util.register_dataclass(CCAState, data_fields=["conv", "value", "slot"], meta_fields=[])


class CCAProjection(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        H, KV, d, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        b = cfg.attention_bias
        self.q_proj = Linear(cfg, D, H * d, bias=b, rngs=rngs)
        self.k_proj = Linear(cfg, D, KV * d, bias=b, rngs=rngs)
        self.v_proj_current = Linear(cfg, D, KV * d // 2, bias=b, rngs=rngs)
        self.v_proj_delayed = Linear(cfg, D, KV * d // 2, bias=b, rngs=rngs)
        C, pdt = cfg.conv_channels, dtypes(cfg)[1]
        init = normal_init(cfg)
        self.conv_qk_depthwise = _Conv(init(rngs.params(), (C, 1, cfg.cca_time0), pdt), jnp.zeros((C,), pdt))
        self.conv_qk_grouped = _Conv(init(rngs.params(), (C, d, cfg.cca_time1), pdt), jnp.zeros((C,), pdt))
        # the four projections as one Linear over their concatenated weights, set only in the decoder's and the
        # scorer's copies of the model (inference/decoder.py): in a decode step each GEMV is a kernel launch of its
        # own, and the convolution reads q and k from the one output in place. Training keeps four: one GEMM
        # measured level on the H200 in forward+backward (docs/experiments.md)
        self.fused = None

    def project(self, x):
        """(qk, v_cur, v_del) of x [B, T, D], qk's first (H + KV) * d channels the q and k heads: through `fused`
        when the model holds it (qk is then its whole output, which the convolution kernel reads in place), else
        the four Linears (qk = [q | k])."""
        if self.fused is None:
            qk = jnp.concatenate([self.q_proj(x), self.k_proj(x)], axis=-1)
            return qk, self.v_proj_current(x), self.v_proj_delayed(x)
        cfg = self.cfg
        k_end = cfg.conv_channels
        v_end = k_end + cfg.num_key_value_heads * cfg.head_dim // 2
        out = self.fused(x)
        return out, out[..., k_end:v_end], out[..., v_end:]

    def __call__(self, x, *, conv_mask=None, state: CCAState | None = None, segment_ids=None, exchange=None):
        """x: [B, T, D] (compute dtype). Returns qk [B,T,H+KV,d] (the query heads, then the key heads), v [B,T,KV,d]
        and the CCAState at the end of this chunk (for caches and context-parallel neighbours). With segment_ids
        [B, T] (packed documents with resets) every document starts as a sequence does: zero conv halo, zero
        delayed-value input.

        exchange(tail, start) -> CCAState (context parallelism, zaya_jax/parallel/context.py) replaces `state`:
        given this chunk's own boundary state `tail` and the sequence-start state `start`, it returns the state
        this chunk starts from (the previous chunk's tail, fetched from the rank that holds it)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dt = x.dtype
        if conv_mask is not None:  # HF zeroes padded positions before any projection
            x = x * conv_mask[:, :, None].astype(dt)

        qk, v_cur, v_del = self.project(x)
        C, P = cfg.conv_channels, cfg.conv_halo
        if exchange is not None:  # context parallel: the halo and delayed value come from the previous chunk
            tail = CCAState(conv=qk[:, T - P:, :C], value=v_del[:, -1])
            zeros = jnp.zeros((B, 1, x.shape[-1]), dt)
            start = CCAState(conv=jnp.zeros((B, P, C), dt), value=self.v_proj_delayed(zeros)[:, 0])
            state = exchange(tail, start)
        # both convolutions and the q/k mean residual paths (ops/cca_conv.py)
        w1 = self.conv_qk_depthwise.weight[...][:, 0, :]  # [C, t0]
        b1, b2 = self.conv_qk_depthwise.bias[...], self.conv_qk_grouped.bias[...]
        w2 = self.conv_qk_grouped.weight[...].astype(dt).reshape(H + KV, d, d, cfg.cca_time1)  # [head, out, in, tap]
        if state is not None and state.slot is not None:  # a cache's chunk: the ring read and written by one op
            if segment_ids is not None:
                raise ValueError("a cache's chunk (CCAState with slot) is one document per row: no segment_ids")
            mixed, conv_state = conv_ops.qk_mix_cached(qk, state.conv, state.slot, w1, b1, w2, b2, H,
                                                       impl=cfg.conv_impl)
        else:
            # at a sequence start the halo is zeros, which the convolution reads without their being concatenated
            zero_halo = state is None or state.conv is None
            prefix = jnp.zeros((B, P, C), dt) if zero_halo else state.conv.astype(dt)
            qk_in = qk if zero_halo else jnp.concatenate([prefix, qk[..., :C]], axis=1)
            mixed = conv_ops.qk_mix(qk_in, w1, b1, w2, b2, H, same_segment_masks(segment_ids, P), impl=cfg.conv_impl,
                                    zero_halo=zero_halo)
            recent = jnp.concatenate([prefix, qk[:, max(T - P, 0):, :C]], axis=1)  # the last P + min(T, P) columns
            conv_state = recent[:, recent.shape[1] - P:]
        if state is None or state.value is None:  # v_proj_delayed(0): zero, or the bias with attention_bias
            v0 = self.v_proj_delayed(jnp.zeros((B, 1, x.shape[-1]), dt))
        else:
            v0 = state.value[:, None].astype(dt)
        v_prev = jnp.concatenate([v0, v_del[:, :-1]], axis=1)
        if segment_ids is not None:
            starts = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool),
                                      segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
            v_zero = self.v_proj_delayed(jnp.zeros((B, 1, x.shape[-1]), dt))
            v_prev = jnp.where(starts[..., None], v_zero, v_prev)
        v = jnp.concatenate([v_cur, v_prev], axis=-1).reshape(B, T, KV, d)
        new_state = CCAState(conv=conv_state, value=v_del[:, -1], slot=None if state is None else state.slot)
        return mixed.reshape(B, T, H + KV, d), v, new_state


def same_segment_masks(segment_ids, P: int):
    """{s: [B, T] float, 1 where position t - s is in t's document} for s = 1..P (positions before the chunk
    count as the same document: their state comes from a cache or a context-parallel neighbour)."""
    if segment_ids is None:
        return None
    out = {}
    for s in range(1, P + 1):
        prev = jnp.concatenate([segment_ids[:, :1].repeat(s, axis=1), segment_ids[:, :-s]], axis=1)
        out[s] = (prev == segment_ids).astype(jnp.float32)
    return out


class _Conv(nnx.Module):
    def __init__(self, weight, bias):
        self.weight = nnx.Param(weight)
        self.bias = nnx.Param(bias)


class QKNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.temp = nnx.Param(jnp.zeros((cfg.num_key_value_heads,), dtypes(cfg)[1]))

    def __call__(self, qk, positions, inv_freq):
        """qk [B, T, H + KV, d] -> q [B, T, H, d], k [B, T, KV, d]: every head L2-normalised to norm sqrt(d), keys
        times temp, then RoPE at positions [B, T] (ops/qk_norm_rope.py; the Pallas kernel under norm_impl
        'pallas')."""
        cos, sin = qk_ops.rope_tables(positions, inv_freq, qk.dtype)
        return qk_ops.qk_norm_rope(qk, self.temp[...], cos, sin, self.cfg.num_attention_heads,
                                   impl=self.cfg.norm_impl)


class CCAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        H, d, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.qkv_proj = CCAProjection(cfg, rngs)
        self.qk_norm = QKNorm(cfg)
        self.o_proj = Linear(cfg, H * d, D, bias=cfg.attention_bias, rngs=rngs)

    def __call__(self, x, *, positions, inv_freq, sliding_window=None, attention_mask=None, state=None,
                 attend=None, segment_ids=None, cca_exchange=None):
        """positions: RoPE positions [B, T]; causal order is the row index. attend(q, k, v) -> o overrides the
        attention call (caches and context parallelism plug in here); cca_exchange: see CCAProjection."""
        B, T, _ = x.shape
        qk, v, new_state = self.qkv_proj(x, conv_mask=attention_mask, state=state, segment_ids=segment_ids,
                                         exchange=cca_exchange)
        q, k = self.qk_norm(qk, positions, inv_freq)
        if attend is None:
            o = attention_ops.attention(q, k, v, impl=self.cfg.attention_impl, kv_valid=attention_mask,
                                        q_segment_ids=segment_ids, sliding_window=sliding_window)
        else:
            o = attend(q, k, v)
        return self.o_proj(o.reshape(B, T, -1)), new_state

"""The fixed-shape decode cache: every layer's K/V, CCA convolution halo and delayed value, held per layer
(LayerSlices) so that each step writes the new token into the layer's own buffers in place.

Rows are left-padded as in HF generation: all rows write the same slot `index`, `kv_valid` marks which slots
hold real tokens (pads never become keys) and `lengths` counts each row's real tokens, which is also the RoPE
position of its next token (HF generate derives positions as cumsum(attention_mask) - 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zaya_jax.model.cca import CCAState
from zaya_jax.model.layer_stack import LayerSlices, unstack_layers
from zaya_jax.model.zaya import ZayaForCausalLM
from zaya_jax.ops import attention as attention_ops


@dataclasses.dataclass
class KVCache:
    k: LayerSlices  # L x [B, S, KV, d] keys after QK-norm, key temperature and RoPE (what HF caches)
    v: LayerSlices  # L x [B, S, KV, d] values (head 0 current-token, head 1 delayed projection)


@dataclasses.dataclass
class DecodeCache:
    kv: KVCache
    cca: CCAState  # conv L x [B, P + 1, C] raw [q | k] columns by slot (a ring, model/cca.py); value L x [B, KV*d/2]
    # the last delayed projection
    kv_valid: jax.Array  # [B, S] bool: slot holds a real (non-pad) token
    lengths: jax.Array  # [B] int32: real tokens so far = RoPE position of the next token
    index: jax.Array  # [] int32: slots written so far (shared by all rows)

    @property
    def max_length(self) -> int:
        return self.kv.k.shape[2]


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v"], meta_fields=[])
jax.tree_util.register_dataclass(DecodeCache, data_fields=["kv", "cca", "kv_valid", "lengths", "index"],
                                 meta_fields=[])


def init_cache(model: ZayaForCausalLM, batch: int, max_length: int) -> DecodeCache:
    """An empty cache in the model's compute dtype. The delayed-value state starts as v_proj_delayed(0) (its bias,
    zero without attention_bias): what the first token of a sequence sees as its previous-token value."""
    cfg = model.cfg
    dt = jnp.dtype(cfg.dtype)
    L, KV, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim

    def per_layer(shape):
        return LayerSlices(jnp.zeros(shape, dt) for _ in range(L))

    v_delayed = model.model.layers.self_attn.qkv_proj.v_proj_delayed
    if v_delayed.bias is None:
        value = per_layer((batch, KV * d // 2))
    else:  # Linear adds its bias in fp32, then casts
        rows = unstack_layers(v_delayed.bias.get_value(), L)  # stacked, or per layer in a Decoder's parameters
        value = LayerSlices(jnp.broadcast_to(b.astype(jnp.float32).astype(dt), (batch, KV * d // 2)) for b in rows)
    return DecodeCache(
        kv=KVCache(per_layer((batch, max_length, KV, d)), per_layer((batch, max_length, KV, d))),
        cca=CCAState(conv=per_layer((batch, cfg.conv_halo + 1, cfg.conv_channels)), value=value),
        kv_valid=jnp.zeros((batch, max_length), bool),
        lengths=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32))


def chunk_positions(cache: DecodeCache, token_mask):
    """RoPE positions of a chunk [B, T]: each row continues from its real-token count; pads get 0 (as HF)."""
    counted = cache.lengths[:, None] + jnp.cumsum(token_mask.astype(jnp.int32), axis=1) - 1
    return jnp.where(token_mask, counted, 0)


def cached_attention(cache: DecodeCache, token_mask, impl: str = "xla"):
    """attend(kv_l, q, k, v, window) for ZayaModel.forward_with_layer_state: writes the chunk's K/V at slots
    [index, index + T) of one layer's cache and attends over every slot written so far (causal in slot order,
    pads masked, sliding windows counted in slots as HF counts cache positions). impl: the model's
    attention_impl; 'cudnn' runs 'xla' here (its fused path takes no per-slot positions, see ops/attention.py)."""
    impl = "xla" if impl == "cudnn" else impl
    T = token_mask.shape[1]
    S = cache.max_length
    index = cache.index
    kv_valid = jax.lax.dynamic_update_slice(cache.kv_valid, token_mask.astype(bool), (0, index))
    q_slots = (index + jnp.arange(T, dtype=jnp.int32))[None]
    kv_slots = jnp.arange(S, dtype=jnp.int32)[None]

    def attend(kv_l: KVCache, q, k, v, sliding_window):
        start = (0, index, 0, 0)
        k_all = jax.lax.dynamic_update_slice(kv_l.k, k.astype(kv_l.k.dtype), start)
        v_all = jax.lax.dynamic_update_slice(kv_l.v, v.astype(kv_l.v.dtype), start)
        o = attention_ops.attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), impl=impl, q_positions=q_slots,
                                    kv_positions=kv_slots, kv_valid=kv_valid, sliding_window=sliding_window)
        return o, KVCache(k_all, v_all)

    return attend, kv_valid


def advance(cache: DecodeCache, kv: KVCache, cca: CCAState, kv_valid, token_mask) -> DecodeCache:
    T = token_mask.shape[1]
    return DecodeCache(kv=kv, cca=cca, kv_valid=kv_valid,
                       lengths=cache.lengths + token_mask.astype(jnp.int32).sum(axis=1),
                       index=cache.index + T)

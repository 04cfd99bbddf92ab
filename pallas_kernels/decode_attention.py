"""One decode step's attention over the cache as one Pallas kernel (Triton lowering; interpret mode on the CPU).

    decode_attention(q [B, H, d], k [B, S, KV, d], v, kv_valid [B, S], index, window) -> o [B, H, d]

The query is the token in slot `index` (every row writes the same slot: inference/cache.py); slot s is visible when
s <= index, index - s < window and kv_valid[b, s]. The contract and roundings are those of
zaya_jax.ops.attention.attention_reference at one query: the scores rounded to the compute dtype, then scaled in fp32;
the probabilities exp(s - max) / sum rounded to the value dtype before the value product, whose fp32 sum is rounded
once.

XLA runs that as five or six kernels per layer (scores, max, exp and sum, normalise, values); here one program per
(row, KV head) holds that head's query heads as the rows of its tiles (padded to 16, the smallest dot) and walks the
visible slots twice: once for the running maximum and sum, once for the normalised probabilities times the values.
At batch 1 that is one launch of KV programs per layer, each reading its head's visible cache (a few hundred KB at
the lengths of a generation); much longer caches would want the slots split over more programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform, vma

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_NN = (((1,), (0,)), ((), ()))  # a @ b
_NEG = float(jnp.finfo(jnp.float32).min)  # the reference's masked score
ROWS = 16  # the smallest dot's rows: a KV head's query heads, padded
SLOTS = 64  # cache slots per step of the walk


def _kernel(index_ref, window_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, *, group, d, slots, scale, precision):
    b, kv = pl.program_id(0), pl.program_id(1)
    index, window = index_ref[0], window_ref[0]
    rows = jnp.arange(ROWS)
    held = rows < group
    heads = kv * group + rows
    cols = jnp.arange(d)[None, :]
    q = q_ref[b, jnp.where(held, heads, kv * group)[:, None], cols]  # padding rows: a copy of the first head
    first = jnp.maximum(index - window + 1, 0) // SLOTS
    last = index // SLOTS + 1

    def scores(step):
        slot = step * SLOTS + jnp.arange(SLOTS)
        in_cache = slot < slots
        at = jnp.minimum(slot, slots - 1)[:, None]
        k = k_ref[b, at, kv, cols]
        s = lax.dot_general(q, k, _NT, precision=precision, preferred_element_type=F32)
        s = s.astype(q.dtype).astype(F32) * scale
        visible = in_cache & (slot <= index) & (index - slot < window) & (valid_ref[b, at[:, 0]] != 0)
        return jnp.where(visible[None, :], s, _NEG), at

    def statistics(step, carry):
        m, total = carry
        s, _ = scores(step)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        return m_new, total * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)

    m, total = lax.fori_loop(first, last, statistics, (jnp.full((ROWS,), _NEG, F32), jnp.zeros((ROWS,), F32)))

    def values(step, acc):
        s, at = scores(step)
        p = (jnp.exp(s - m[:, None]) / total[:, None]).astype(v_ref.dtype)
        return acc + lax.dot_general(p, v_ref[b, at, kv, cols], _NN, precision=precision, preferred_element_type=F32)

    o = lax.fori_loop(first, last, values, jnp.zeros((ROWS, d), F32))
    # padding rows keep an out-of-range head: a GPU skips masked lanes, the interpreter's scatter drops them
    plgpu.store(o_ref.at[b, jnp.where(held, heads, o_ref.shape[1])[:, None], cols], o.astype(o_ref.dtype),
                mask=held[:, None])


def supported(q_heads: int, kv_heads: int, head_dim: int, slots: int) -> bool:
    """Shapes the kernel takes: a KV head's query heads fit one tile, the head width is a power of two >= 16."""
    group = q_heads // kv_heads
    return (q_heads % kv_heads == 0 and group <= ROWS and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and slots >= 1)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def decode_attention(q, k, v, kv_valid, index, window=None, *, scale: float | None = None,
                     interpret: bool | None = None):
    """q [B, H, d], k / v [B, S, KV, d], kv_valid [B, S], index: the query's slot (int32 scalar), window: the sliding
    window (None, an int or a traced int32 scalar) -> o [B, H, d] in q.dtype."""
    B, H, d = q.shape
    S, KV = k.shape[1], k.shape[2]
    if k.shape != (B, S, KV, d) or v.shape != k.shape or kv_valid.shape != (B, S):
        raise ValueError(f"decode_attention: q {q.shape}, k {k.shape}, v {v.shape}, kv_valid {kv_valid.shape} do not "
                         "match ([B, H, d], [B, S, KV, d], [B, S])")
    if not supported(H, KV, d, S):
        raise ValueError(f"decode_attention: {H} query heads over {KV} KV heads of width {d} (at most {ROWS} query "
                         "heads per KV head, a power-of-two width >= 16)")
    scale = d ** -0.5 if scale is None else scale
    big = jnp.iinfo(jnp.int32).max // 2
    window = jnp.full((1,), big if window is None else window, jnp.int32)
    index = jnp.reshape(index, (1,)).astype(jnp.int32)
    interpret = platform.interpret() if interpret is None else interpret
    args = vma.vary_to_union(index, window, q, k.astype(q.dtype), v.astype(q.dtype), kv_valid.astype(jnp.int32))
    kernel = functools.partial(_kernel, group=H // KV, d=d, slots=S, scale=float(scale),
                               precision=platform.dot_precision(q.dtype))
    return pl.pallas_call(kernel, grid=(B, KV), out_shape=vma.out_struct((B, H, d), q.dtype, args[2]),
                          compiler_params=platform.compiler_params(4, 1), interpret=interpret,
                          name="decode_attention")(*args)


__all__ = ["ROWS", "SLOTS", "decode_attention", "supported"]

"""Causal grouped-query flash attention for CCA's compressed heads (Pallas via Triton; interpret mode on the CPU).

Same contract as `zaya_jax.ops.attention.attention_reference`: q [B, T, H, d], k/v [B, S, KV, d], H % KV == 0,
query head h reads KV head h // (H // KV); key s is visible to query t when kv_pos[s] <= q_pos[t],
(q_pos[t] - kv_pos[s] < sliding_window), kv_valid[s] and equal segment ids. Positions may be any int32 arrays
([T] or [B, T]): zigzag context-parallel chunks pass their global positions. sliding_window may be a Python
int or a traced int32 scalar (scanned layers with per-layer windows). Softmax statistics are fp32.

`attention_with_lse` also returns lse [B, H, T] (natural log, -inf for a query that sees no key) and is
differentiable in both outputs, so context-parallel chunks can be merged with
o = sum_c exp(lse_c - lse) o_c. A query that sees no key gets a zero output (the jnp reference instead averages
over all keys there); every other query matches the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _attention_blocks as blocks_lib
from pallas_kernels import _attention_kernels as kern
from pallas_kernels import platform
from pallas_kernels import vma
from pallas_kernels.platform import AttentionBlocks

LN2 = math.log(2.0)
# The 'tiles' backward holds dS between its two kernels (at B=1, T=32768, 8 heads, bf16, causal: 8.6 GB); past
# this it takes the split path.
TILES_MAX_BYTES = 16 << 30


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    window: int | None  # the sliding window when it is a Python int (used for static loop ranges)
    blocks: AttentionBlocks
    q_len: int
    kv_len: int
    static_positions: bool  # no position / padding / segment arrays, no traced window: ranges known at trace time


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_axis(x, axis: int, size: int, value):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    if value == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _static_positions(batch: int, length: int, padded: int, pad_value: int) -> np.ndarray:
    pos = np.full((padded,), pad_value, np.int32)
    pos[:length] = np.arange(length, dtype=np.int32)
    return np.broadcast_to(pos, (batch, padded))


def _loop_ranges(cfg: _Config, q_pos, kv_pos, q_seg, kv_seg, window, block_q: int, block_k: int,
                 per_kv_block: bool, as_numpy: bool = False):
    if cfg.static_positions:
        window = cfg.window
        batch = q_pos.shape[0]
        q_pos = _static_positions(batch, cfg.q_len, q_pos.shape[1], blocks_lib.Q_PAD_POSITION)
        kv_pos = _static_positions(batch, cfg.kv_len, kv_pos.shape[1], blocks_lib.KV_PAD_POSITION)
    elif window is not None:
        window = window[0]
    return blocks_lib.ranges(q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k,
                             per_kv_block=per_kv_block, static=cfg.static_positions, as_numpy=as_numpy)


# ------------------------------------------------------------------------------------------------ custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, cfg: _Config):
    return _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, cfg)[0]


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, cfg: _Config):
    b = cfg.blocks
    masks = (q_pos, kv_pos, q_seg, kv_seg, window)
    ranges = _loop_ranges(cfg, *masks, b.fwd_q, b.fwd_k, per_kv_block=False)
    o, lse2 = kern.forward(q, k, v, *masks, ranges, scale=cfg.scale, blocks=b)
    return (o, lse2), (q, k, v, masks, o, lse2)


def _tiles_plan(cfg: _Config, q, k, dkv_ranges):
    """(dk/dv loop ranges with dS tile offsets, n_tiles) of the 'tiles' backward; None where dS would exceed
    TILES_MAX_BYTES. dkv_ranges are NumPy with static positions (dS then has exactly the tiles the loops visit)."""
    ranges, n_tiles, ds_bytes = kern.ds_tile_plan(q.shape, k.shape, q.dtype, cfg.blocks, dkv_ranges,
                                                  cfg.static_positions)
    return None if ds_bytes > TILES_MAX_BYTES else (ranges, n_tiles)


def _flash_bwd(cfg: _Config, res, cotangents):
    q, k, v, masks, o, lse2 = res
    do, dlse2 = cotangents
    # d lse2 / d s_j = log2(e) p_j, so an lse cotangent enters exactly like a shift of delta = rowsum(o * do).
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse2 * kern.LOG2E
    delta = jnp.where(lse2 >= 0.5 * kern.DEAD_LSE, 0.0, delta)  # rows that see no key: nothing to propagate
    do = do.astype(q.dtype)
    b = cfg.blocks
    dkv_ranges = _loop_ranges(cfg, *masks, b.dkv_q, b.dkv_k, per_kv_block=True, as_numpy=True)
    tiles = _tiles_plan(cfg, q, k, dkv_ranges) if b.bwd == "tiles" else None
    dkv_ranges = jnp.asarray(dkv_ranges)
    if tiles is not None:
        kv_ranges, n_tiles = tiles
        dk, dv, ds = kern.backward_dkv_tiles(q, k, v, do, lse2, delta, *masks, kv_ranges, scale=cfg.scale, blocks=b,
                                             n_tiles=n_tiles)
        q_ranges = _loop_ranges(cfg, *masks, b.dkv_q, b.dkv_k, per_kv_block=False)
        dq = kern.backward_dq_tiles(ds, k, q_ranges, kv_ranges, scale=cfg.scale, blocks=b, q_shape=q.shape,
                                    q_dtype=q.dtype)
    else:
        dq_ranges = _loop_ranges(cfg, *masks, b.dq_q, b.dq_k, per_kv_block=False)
        dq = kern.backward_dq(q, k, v, do, lse2, delta, *masks, dq_ranges, scale=cfg.scale, blocks=b)
        dk, dv = kern.backward_dkv(q, k, v, do, lse2, delta, *masks, dkv_ranges, scale=cfg.scale, blocks=b)
    # Inside shard_map the kernels ran on values varying over every input's mesh axes: a gradient is summed over
    # the axes its primal is invariant over (e.g. K/V gathered whole onto every context-parallel device).
    dq, dk, dv = (vma.sum_to_type_of(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------------- public API
def _positions(positions, batch: int, length: int):
    if positions is None:
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (batch, length))
    return jnp.broadcast_to(positions.astype(jnp.int32), (batch, length))


def attention_with_lse(q, k, v, *, q_positions=None, kv_positions=None, kv_valid=None, q_segment_ids=None,
                       kv_segment_ids=None, sliding_window=None, scale=None, blocks: AttentionBlocks | None = None):
    """-> (o [B, T, H, d] q.dtype, lse [B, H, T] fp32)."""
    B, T, H, d = q.shape
    S, KV = k.shape[1], k.shape[2]
    if H % KV or v.shape != k.shape or k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"attention: need q [B,T,H,d], k = v [B,S,KV,d] with H % KV == 0; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    scale = d ** -0.5 if scale is None else float(scale)
    blocks = (blocks or platform.attention_blocks(d, T)).clipped(T, S)
    Tp = _round_up(T, max(blocks.fwd_q, blocks.dq_q, blocks.dkv_q))
    Sp = _round_up(S, max(blocks.fwd_k, blocks.dq_k, blocks.dkv_k))
    dp = max(16, platform.next_pow2(d))
    static_window = sliding_window is None or isinstance(sliding_window, (int, np.integer))
    static = static_window and all(a is None for a in (q_positions, kv_positions, kv_valid, q_segment_ids,
                                                       kv_segment_ids))
    cfg = _Config(scale=scale, window=int(sliding_window) if static_window and sliding_window is not None else None,
                  blocks=blocks, q_len=T, kv_len=S, static_positions=static)
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32).reshape(1)

    q_pos, kv_pos = _positions(q_positions, B, T), _positions(kv_positions, B, S)
    if kv_valid is not None:
        kv_pos = jnp.where(kv_valid.astype(bool), kv_pos, blocks_lib.KV_PAD_POSITION)
    q_pos = _pad_axis(q_pos, 1, Tp, blocks_lib.Q_PAD_POSITION)
    kv_pos = _pad_axis(kv_pos, 1, Sp, blocks_lib.KV_PAD_POSITION)
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        q_seg = _pad_axis(jnp.broadcast_to(q_segment_ids.astype(jnp.int32), (B, T)), 1, Tp, "edge")
        kv_seg = _pad_axis(jnp.broadcast_to(kv_segment_ids.astype(jnp.int32), (B, S)), 1, Sp, "edge")

    qp = _pad_axis(_pad_axis(q, 1, Tp, 0), 3, dp, 0)
    kp = _pad_axis(_pad_axis(k, 1, Sp, 0), 3, dp, 0)
    vp = _pad_axis(_pad_axis(v, 1, Sp, 0), 3, dp, 0)
    o, lse2 = _flash(qp, kp, vp, q_pos, kv_pos, q_seg, kv_seg, window, cfg)
    o, lse2 = o[:, :T, :, :d], lse2[:, :, :T]
    lse = jnp.where(lse2 >= 0.5 * kern.DEAD_LSE, -jnp.inf, lse2 * LN2)
    return o, lse


def attention(q, k, v, *, q_positions=None, kv_positions=None, kv_valid=None, q_segment_ids=None,
              kv_segment_ids=None, sliding_window=None, scale=None, blocks: AttentionBlocks | None = None):
    """-> o [B, T, H, d] in q.dtype."""
    return attention_with_lse(q, k, v, q_positions=q_positions, kv_positions=kv_positions, kv_valid=kv_valid,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              sliding_window=sliding_window, scale=scale, blocks=blocks)[0]

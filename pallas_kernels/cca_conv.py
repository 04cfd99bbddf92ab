"""CCA's query/key mixing as Pallas kernels (Triton lowering; interpret mode on the CPU), with a custom VJP. Same
contract and numerics as `zaya_jax.ops.cca_conv.qk_mix_reference` (the rounding points of the reference kept):

    qk_mix(xp [B, T + P, C'], w1 [C, t0], b1 [C], w2 [G, d, d, t1], b2 [C], heads, same_segment, zero_halo)
        -> [B, T, C]

with two liberties the reference does not take: the mixed channels may be the first C = G * d of a wider array (the
decoder's and the scorer's fused q/k/v projection output, read in place instead of sliced), and with zero_halo x
holds only the T positions, the P zero columns before t = 0 implied instead of concatenated (a sequence start).
qk_mix_cached reads those P columns from a cache's ring (by slot) instead, and writes the chunk into the ring.

Forward, one kernel: a program owns `rows` time rows of one head's d channels (grid: batch x row tiles x heads). It
reads the P + 1 shifted views of its input rows once, forms the t1 depthwise taps in fp32 (rounded as the reference
rounds them), multiplies each by the head's d x d grouped-conv tap on the tensor cores, adds the bias and the head's
mean residual (a query head: (q + k) / 2 with its KV head's k; a KV head: the mean of that over its query heads, whose
projections it reads too) and writes the head's output once.

Backward, two kernels. (A) the grouped convolution, per (batch, head, chunk of row tiles, tap): d y_j = dout . w2_j is
written, d w2_j (the tap recomputed from xp) and d b2 are summed over the chunk's rows in registers. (B) the depthwise
convolution and the residual paths, per (batch, tile of xp rows u, head): reads d y_j at u - P + s for every offset s,
so one pass gives d xp (with the residual paths' gradient of row u, from the head's and its partner heads' d out) and
the tile's partial sums of d w1 and d b1. All partial sums are added afterwards in fp32.

Shifted reads are row gathers clamped into the array and zeroed outside it (nothing is padded or copied); the last
tile's stores are masked. Inside shard_map (check_vma) the kernels run on inputs made varying over all their axes, and
the weight gradients are summed back to their primals' types (`vma`).

Measured and dropped: kernel B recomputing d y_j = d out . w2_j for its rows (five small matmuls and the head's
w2 taps per tile) instead of kernel A storing it: slower forward+backward on the H200 (docs/experiments.md).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform
from pallas_kernels import vma
from pallas_kernels.cca_conv_taps import halo, tap_offset

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b

# (time rows, forward warps, backward (A) warps, backward (A) pipeline stages) of a head's tile: one warp group holds
# the forward's [rows, d] matmul tiles, two the backward's [d, d] fp32 weight-gradient sum; (time rows, warps) of the
# depthwise backward (B), a bandwidth-bound elementwise pass over a head's channels
_HEAD_TILES = {"cuda": (64, 4, 8, 1), "rocm": (64, 2, 4, 1), "cpu": (16, 4, 4, 1)}
_DW_TILES = {"cuda": (64, 8), "rocm": (64, 4), "cpu": (16, 4)}
# backward (A): (batch, head, chunk, tap) programs per compute unit
_PROGRAMS_PER_CU = {"cuda": 2, "rocm": 2, "cpu": 2}


@contextlib.contextmanager
def tiles_override(head: tuple[int, int, int, int], depthwise: tuple[int, int],
                   programs_per_cu: int | None = None):
    """Kernels traced inside use these (rows, forward warps, backward (A) warps, backward (A) stages) and (rows,
    warps) on this backend, and backward (A) this many programs per compute unit (the kernel benchmark times
    candidates end to end)."""
    vendor = platform.vendor()
    saved = _HEAD_TILES[vendor], _DW_TILES[vendor], _PROGRAMS_PER_CU[vendor]
    _HEAD_TILES[vendor], _DW_TILES[vendor] = head, depthwise
    _PROGRAMS_PER_CU[vendor] = programs_per_cu or saved[2]
    try:
        yield
    finally:
        _HEAD_TILES[vendor], _DW_TILES[vendor], _PROGRAMS_PER_CU[vendor] = saved


def _fit_rows(rows: int, T: int) -> int:
    """A tile of at most `rows` time rows, no taller than T rounded up to a power of two (at least 16)."""
    return min(rows, max(16, platform.next_pow2(T)))


def _head_tiles(T: int) -> tuple[int, int, int, int]:
    rows, fwd_warps, bwd_warps, bwd_stages = _HEAD_TILES[platform.vendor()]
    return _fit_rows(rows, T), fwd_warps, bwd_warps, bwd_stages


def _row_index(first, rows: int, n: int):
    """(rows first .. first + rows - 1 clamped into [0, n), which of them are in [0, n)): clamped gathers read no
    row out of bounds (also in interpret mode, which cannot mask a slice that starts before 0)."""
    r = first + jnp.arange(rows)
    return jnp.clip(r, 0, n - 1), (r >= 0) & (r < n)


def _load_rows(ref, first, rows: int, n: int):
    """ref[first + r, :] for r < rows as fp32, zero where the row is outside [0, n)."""
    idx, ok = _row_index(first, rows, n)
    return jnp.where(ok[:, None], ref[idx, :].astype(F32), 0.0)


def _load_mask(ref, s: int, first, rows: int, n: int):
    idx, ok = _row_index(first, rows, n)
    return jnp.where(ok, ref[s - 1, idx], 0.0)[:, None]


def _store_rows(ref, first, value, n: int):
    """ref[first + r, :] = value[r] for the rows below n."""
    ok = (first + jnp.arange(value.shape[0])) < n
    plgpu.store(ref.at[pl.ds(first, value.shape[0]), :], value.astype(ref.dtype),
                mask=jnp.broadcast_to(ok[:, None], value.shape))


def _round(x, dtype):
    """x rounded to dtype, back in fp32 (a no-op for fp32)."""
    return x.astype(dtype).astype(F32)


def _ring_rows(slot, times, n: int):
    """Where a cache ring of n columns holds the chunk times `times` (relative to the chunk's first slot; > -n)."""
    return lax.rem(slot + times + n, n)


def _shifted_views(x_ref, m_ref, start, rows: int, *, P: int, T: int, off: int, offsets=None, ring=None):
    """{s: the input at times start - s .. (fp32), times same_segment[s] of the output rows} for s in offsets
    (0 .. P). x holds `off` halo rows before t = 0 (P, or 0 when the halo is implied zeros or held in a cache's ring:
    ring = (its ref [P + 1, d], the chunk's first slot))."""
    views = {}
    for s in range(P + 1) if offsets is None else sorted(set(offsets)):
        col = _load_rows(x_ref, start + off - s, rows, T + off)
        if ring is not None:
            ring_ref, slot = ring
            times = start - s + jnp.arange(rows)
            col = jnp.where((times < 0)[:, None], ring_ref[_ring_rows(slot, times, P + 1), :].astype(F32), col)
        if m_ref is not None and s:
            col = col * _load_mask(m_ref, s, start, rows, T)
        views[s] = col
    return views


def _tap(views, w1_ref, b1_ref, j: int, *, t0: int, t1: int, dtype):
    """Depthwise tap j of the viewed rows, summed in the reference's order and rounded to dtype (fp32 values)."""
    y = b1_ref[...].astype(F32)[None, :]
    for i in range(t0):
        y = y + views[tap_offset(j, i, t0, t1)] * w1_ref[i, :].astype(F32)[None, :]
    return _round(y, dtype)


def _query_residual(q, k, dtype):
    return _round(_round(q + k, dtype) * 0.5, dtype)


def _head_spec(length: int, d: int, head_axis: int, block_of=lambda g: g):
    """BlockSpec of a [B, length, C] array seen per head: grid axis 0 is the batch, axis `head_axis` the head g, whose
    block is the d channels of head block_of(g)."""
    return pl.BlockSpec((None, length, d), lambda *p: (p[0], 0, block_of(p[head_axis])))


def _head_specs(length: int, d: int, heads: int, kv: int, head_axis: int):
    """The head's own channels, its KV head's (query heads) and the query heads of its group (KV heads)."""
    group = heads // kv
    own = _head_spec(length, d, head_axis)
    kv_head = _head_spec(length, d, head_axis, lambda g: heads + lax.div(jnp.minimum(g, heads - 1), group))
    group_heads = [_head_spec(length, d, head_axis,
                              lambda g, h=h: jnp.minimum(jnp.maximum(g - heads, 0), kv - 1) * group + h)
                   for h in range(group)]
    return own, kv_head, group_heads


# ------------------------------------------------------------------------------------------------------ forward
def _fwd_kernel(x_ref, xkv_ref, *rest, t0, t1, P, T, off, rows, heads, group, has_seg, has_ring, precision):
    xq_refs, (w1_ref, b1_ref, w2_ref, b2_ref), rest = rest[:group], rest[group:group + 4], rest[group + 4:]
    ring_ref, slot_ref, rest = (*rest[:2], rest[2:]) if has_ring else (None, None, rest)
    m_ref, rest = (rest[0], rest[1:]) if has_seg else (None, rest)
    o_ref, ring_out = rest if has_ring else (rest[0], None)
    dt = o_ref.dtype
    g = pl.program_id(2)
    start = pl.program_id(1) * rows
    slot = slot_ref[0] if has_ring else None
    views = _shifted_views(x_ref, m_ref, start, rows, P=P, T=T, off=off,
                           ring=None if ring_ref is None else (ring_ref, slot))
    z = b2_ref[...].astype(F32)[None, :]
    for j in range(t1):
        y = _tap(views, w1_ref, b1_ref, j, t0=t0, t1=t1, dtype=dt).astype(dt)
        z = z + _round(lax.dot_general(y, w2_ref[j], _NT, precision=precision, preferred_element_type=F32), dt)
    z = _round(z, dt)
    own = views[0]  # the head's own projections at the output rows

    @pl.when(g < heads)
    def _query_head():
        res = _query_residual(own, _load_rows(xkv_ref, start + off, rows, T + off), dt)
        _store_rows(o_ref, start, z + res, T)

    @pl.when(g >= heads)
    def _kv_head():
        total = sum(_query_residual(_load_rows(q_ref, start + off, rows, T + off), own, dt) for q_ref in xq_refs)
        _store_rows(o_ref, start, z + _round(total / group, dt), T)

    if has_ring:
        @pl.when(pl.program_id(1) == 0)
        def _write_ring():
            n = P + 1
            if T == 1:  # in place (the ring is aliased): the token's column, at the one position no view reads
                plgpu.store(ring_out.at[pl.ds(_ring_rows(slot, 0, n), 1), :], x_ref[...].astype(ring_out.dtype))
            else:  # a new ring: each position's latest time, from the chunk or, before it, from the old ring
                p = jnp.arange(platform.next_pow2(n))
                times = T - 1 - lax.rem(slot + T - 1 - p + n, n)
                cols = jnp.where((times < 0)[:, None], ring_ref[jnp.minimum(p, n - 1), :].astype(F32),
                                 x_ref[jnp.clip(times, 0, T - 1), :].astype(F32))
                for i in range(n):  # row by row: a slice of n rows is not a power of two, and a masked store of a
                    # power-of-two tile reaching past the ring's end is out of bounds to the indexer
                    ring_out[i, :] = jnp.sum(jnp.where((p == i)[:, None], cols, 0.0), axis=0).astype(ring_out.dtype)


def _forward(xp, w1, b1, w2, b2, masks, *, heads: int, off: int, ring=None, slot=None):
    """The mix of xp (`off` halo columns before its T positions), or with a cache's `ring` [B, P + 1, C] and the
    chunk's first `slot` [1] (off 0) the mix and the ring including the chunk (for one token: the same buffer)."""
    B, Tp, _ = xp.shape
    G, d, _, t1 = w2.shape
    C, t0 = G * d, w1.shape[1]
    P = halo(t0, t1)
    T = Tp - off
    rows, warps, _, _ = _head_tiles(T)
    x, w1t, b1, w2t, b2, m, h = vma.vary_to_union(xp, _tap_weights(w1), b1, _per_tap(w2), b2, masks, ring)
    own, kv_head, group_heads = _head_specs(Tp, d, heads, G - heads, head_axis=2)
    in_specs = [own, kv_head, *group_heads,
                pl.BlockSpec((w1t.shape[0], d), lambda n, i, g: (0, g)), pl.BlockSpec((d,), lambda n, i, g: (g,)),
                pl.BlockSpec((t1, None, d, d), lambda n, i, g: (0, g, 0, 0)), pl.BlockSpec((d,), lambda n, i, g: (g,))]
    args = [x, x, *[x] * len(group_heads), w1t, b1, w2t, b2]
    out_specs, out_shape = _head_spec(T, d, head_axis=2), vma.out_struct((B, T, C), xp.dtype, x)
    aliases = {}
    if h is not None:
        if T == 1:
            aliases = {len(args): 1}
        in_specs += [_head_spec(P + 1, d, head_axis=2), pl.BlockSpec((1,), lambda n, i, g: (0,))]
        args += [h, slot]
        out_specs, out_shape = [out_specs, in_specs[-2]], [out_shape, vma.out_struct(h.shape, h.dtype, x)]
    if m is not None:
        in_specs.append(pl.BlockSpec((m.shape[0], None, T), lambda n, i, g: (0, n, 0)))
        args.append(m)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, t0=t0, t1=t1, P=P, T=T, off=off, rows=rows, heads=heads,
                          group=len(group_heads), has_seg=m is not None, has_ring=h is not None,
                          precision=platform.dot_precision(xp.dtype)),
        grid=(B, pl.cdiv(T, rows), G),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=platform.compiler_params(warps, 2),
        interpret=platform.interpret(), name="cca_qk_mix_fwd",
    )(*args)


def _tap_weights(w1):
    """[C, t0] -> [t0', C] (t0' = t0 rounded up to a power of two, a Triton block dimension). The kernels cast the
    weights and biases to fp32 as they read them: a cast here would be a size-inflating op, which XLA does not hoist
    out of the decode loop, so every generated token would convert every layer's weights again."""
    t0 = w1.shape[1]
    return jnp.pad(w1.T, ((0, platform.next_pow2(t0) - t0), (0, 0)))


def _per_tap(w2):
    """[G, d, d, t1] -> [t1, G, d, d] (each tap's d x d matrices contiguous)."""
    return jnp.moveaxis(w2, -1, 0)


# ------------------------------------------------------------------------------- backward (A): grouped convolution
def _bwd_grouped_kernel(x_ref, do_ref, w1_ref, b1_ref, w2_ref, *rest, t0, t1, P, T, off, rows, chunks, has_seg,
                        precision):
    m_ref, rest = (rest[0], rest[1:]) if has_seg else (None, rest)
    dy_ref, dw2_ref, db2_ref = rest
    dt = dy_ref.dtype
    c, tap = pl.program_id(2), pl.program_id(3)
    count = lax.div(pl.cdiv(T, rows) - c + chunks - 1, chunks)  # this chunk's row tiles c, c + chunks, ...
    d = do_ref.shape[-1]
    w2 = w2_ref[...]  # this head's tap, read once

    def run(j: int):
        def step(n, carry):
            start = (c + n * chunks) * rows
            dout = _load_rows(do_ref, start, rows, T).astype(dt)  # zero past T: those rows add nothing
            views = _shifted_views(x_ref, m_ref, start, rows, P=P, T=T, off=off,
                                   offsets=[tap_offset(j, i, t0, t1) for i in range(t0)])
            y = _tap(views, w1_ref, b1_ref, j, t0=t0, t1=t1, dtype=dt).astype(dt)
            _store_rows(dy_ref, start, lax.dot_general(dout, w2, _NN, precision=precision,
                                                       preferred_element_type=F32), T)
            dw = carry[0] + lax.dot_general(dout, y, _TN, precision=precision, preferred_element_type=F32)
            return dw, (carry[1] + jnp.sum(dout.astype(F32), axis=0)) if j == 0 else carry[1]

        dw, db = lax.fori_loop(0, count, step, (jnp.zeros((d, d), F32), jnp.zeros((d,), F32)))
        dw2_ref[...] = dw
        if j == 0:
            db2_ref[...] = db

    for j in range(t1):
        pl.when(tap == j)(functools.partial(run, j))


def _backward_grouped(xp, w1, b1, w2, masks, dout, *, off: int):
    """-> (d y [t1, B, T, C] in xp.dtype, d w2 [G, d, d, t1] fp32, d b2 [C] fp32)."""
    B, Tp, _ = xp.shape
    G, d, _, t1 = w2.shape
    C, t0 = G * d, w1.shape[1]
    P = halo(t0, t1)
    T = Tp - off
    rows, _, warps, stages = _head_tiles(T)
    n_tiles = pl.cdiv(T, rows)
    per_cu = _PROGRAMS_PER_CU[platform.vendor()]
    chunks = max(1, min(n_tiles, math.ceil(per_cu * platform.compute_units() / (B * G * t1))))
    x, do, w1t, b1, w2t, m = vma.vary_to_union(xp, dout, _tap_weights(w1), b1, _per_tap(w2), masks)
    in_specs = [_head_spec(Tp, d, head_axis=1), _head_spec(T, d, head_axis=1),
                pl.BlockSpec((w1t.shape[0], d), lambda n, g, c, j: (0, g)),
                pl.BlockSpec((d,), lambda n, g, c, j: (g,)),
                pl.BlockSpec((None, None, d, d), lambda n, g, c, j: (j, g, 0, 0))]
    args = [x, do, w1t, b1, w2t]
    if m is not None:
        in_specs.append(pl.BlockSpec((m.shape[0], None, T), lambda n, g, c, j: (0, n, 0)))
        args.append(m)
    out_specs = [pl.BlockSpec((None, None, T, d), lambda n, g, c, j: (j, n, 0, g)),
                 pl.BlockSpec((None, None, None, None, d, d), lambda n, g, c, j: (n, c, j, g, 0, 0)),
                 pl.BlockSpec((None, None, d), lambda n, g, c, j: (n, c, g))]
    out_shape = [vma.out_struct((t1, B, T, C), xp.dtype, x), vma.out_struct((B, chunks, t1, G, d, d), F32, x),
                 vma.out_struct((B, chunks, C), F32, x)]
    dy, dw2, db2 = pl.pallas_call(
        functools.partial(_bwd_grouped_kernel, t0=t0, t1=t1, P=P, T=T, off=off, rows=rows, chunks=chunks,
                          has_seg=m is not None, precision=platform.dot_precision(xp.dtype)),
        grid=(B, G, chunks, t1),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        # one stage by default: 1-3 stages measured within noise of each other on the H200 (docs/experiments.md)
        compiler_params=platform.compiler_params(warps, stages),
        interpret=platform.interpret(), name="cca_qk_mix_bwd_grouped",
    )(*args)
    return dy, jnp.moveaxis(dw2.sum(axis=(0, 1)), 0, -1), db2.sum(axis=(0, 1))


# ------------------------------------------------------------------ backward (B): depthwise conv and residual paths
def _bwd_depthwise_kernel(x_ref, w_ref, *rest, t0, t1, T, off, rows, heads, group, has_seg):
    dy_refs, (do_ref, dokv_ref), rest = rest[:t1], rest[t1:t1 + 2], rest[t1 + 2:]
    doq_refs, rest = rest[:group], rest[group:]
    m_ref = rest[0] if has_seg else None
    dx_ref, db_ref, *dw_refs = rest[1:] if has_seg else rest
    dt = dx_ref.dtype
    g = pl.program_id(2)
    start = pl.program_id(1) * rows  # this program's rows u of d xp, at times u - off
    x = _load_rows(x_ref, start, rows, T + off)
    dx = jnp.zeros(x.shape, F32)
    dw = [jnp.zeros(x.shape[1:], F32) for _ in range(t0)]
    for j in range(t1):
        for i in range(t0):
            s = tap_offset(j, i, t0, t1)
            gj = _load_rows(dy_refs[j], start - off + s, rows, T)  # dy_j at t = u - off + s
            if has_seg and s:
                gj = gj * _load_mask(m_ref, s, start - off + s, rows, T)
            dx = dx + gj * w_ref[i, :].astype(F32)[None, :]
            dw[i] = dw[i] + jnp.sum(x * gj, axis=0)
    db = jnp.zeros(x.shape[1:], F32)
    for j in range(t1):  # every output t once: rows t = u of each tap gradient
        db = db + jnp.sum(_load_rows(dy_refs[j], start, rows, T), axis=0)
    db_ref[...] = db
    for i in range(t0):
        dw_refs[i][...] = dw[i]
    dx = _round(dx, dt)

    # The mean residual paths (rows u = off + t are the projections), rounded as the reference rounds them: a query
    # head gets d q_res / 2, d q_res its own output's gradient plus its share of its KV head's mean; a KV head the
    # sum of that over its query heads (the transpose of the repeat). Added to the convolutions' gradient in dt.
    def d_qres_half(dq_ref, dk_share):
        return _round(_round(_load_rows(dq_ref, start - off, rows, T) + dk_share, dt) * 0.5, dt)

    @pl.when(g < heads)
    def _query_head():
        share = _round(_load_rows(dokv_ref, start - off, rows, T) / group, dt)
        _store_rows(dx_ref, start, dx + d_qres_half(do_ref, share), T + off)

    @pl.when(g >= heads)
    def _kv_head():
        share = _round(_load_rows(do_ref, start - off, rows, T) / group, dt)
        _store_rows(dx_ref, start, dx + _round(sum(d_qres_half(q_ref, share) for q_ref in doq_refs), dt), T + off)


def _backward_depthwise(xp, w1, masks, dy, dout, *, heads: int, num_heads: int):
    """-> (d xp [B, T + off, C] in xp.dtype (the mixed channels only), d w1 [C, t0] fp32, d b1 [C] fp32)."""
    B, Tp, _ = xp.shape
    T, C, t0, t1 = dout.shape[1], dout.shape[2], w1.shape[1], dy.shape[0]
    off = Tp - T
    G, d = num_heads, C // num_heads
    rows, warps = _DW_TILES[platform.vendor()]
    rows = _fit_rows(rows, T)
    nU = pl.cdiv(Tp, rows)
    x, w, m, g, do = vma.vary_to_union(xp, _tap_weights(w1), masks, dy, dout)
    own, kv_head, group_heads = _head_specs(T, d, heads, G - heads, head_axis=2)
    in_specs = ([_head_spec(Tp, d, head_axis=2),
                 pl.BlockSpec((w.shape[0], d), lambda n, i, h: (0, h))]
                + [pl.BlockSpec((None, None, T, d), lambda n, i, h, j=j: (j, n, 0, h)) for j in range(t1)]
                + [own, kv_head, *group_heads])
    args = [x, w, *[g] * t1, do, do, *[do] * len(group_heads)]
    if m is not None:
        in_specs.append(pl.BlockSpec((m.shape[0], None, T), lambda n, i, h: (0, n, 0)))
        args.append(m)
    part = pl.BlockSpec((None, None, d), lambda n, i, h: (n, i, h))
    outs = pl.pallas_call(
        functools.partial(_bwd_depthwise_kernel, t0=t0, t1=t1, T=T, off=off, rows=rows, heads=heads,
                          group=len(group_heads), has_seg=m is not None),
        grid=(B, nU, G),
        in_specs=in_specs,
        out_specs=[_head_spec(Tp, d, head_axis=2)] + [part] * (1 + t0),
        out_shape=[vma.out_struct((B, Tp, C), xp.dtype, x)] + [vma.out_struct((B, nU, C), F32, x)] * (1 + t0),
        compiler_params=platform.compiler_params(warps, 1),
        interpret=platform.interpret(), name="cca_qk_mix_bwd_depthwise",
    )(*args)
    return outs[0], jnp.stack([p.sum(axis=(0, 1)) for p in outs[2:]], axis=1), outs[1].sum(axis=(0, 1))


# -------------------------------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _mix(xp, w1, b1, w2, b2, masks, heads, off):
    return _forward(xp, w1, b1, w2, b2, masks, heads=heads, off=off)


def _mix_fwd(xp, w1, b1, w2, b2, masks, heads, off):
    return _mix(xp, w1, b1, w2, b2, masks, heads, off), (xp, w1, b1, w2, b2, masks)


def _mix_bwd(heads, off, res, dout):
    xp, w1, b1, w2, b2, masks = res
    dy, dw2, db2 = _backward_grouped(xp, w1, b1, w2, masks, dout, off=off)
    dx, dw1, db1 = _backward_depthwise(xp, w1, masks, dy, dout, heads=heads, num_heads=w2.shape[0])
    if dx.shape[-1] < xp.shape[-1]:  # channels past the mixed ones (a fused projection's values) get no gradient
        dx = jnp.pad(dx, ((0, 0), (0, 0), (0, xp.shape[-1] - dx.shape[-1])))
    return (vma.sum_to_type_of(dx, xp), vma.sum_to_type_of(dw1.astype(w1.dtype), w1),
            vma.sum_to_type_of(db1.astype(b1.dtype), b1), vma.sum_to_type_of(dw2.astype(w2.dtype), w2),
            vma.sum_to_type_of(db2.astype(b2.dtype), b2), None if masks is None else jnp.zeros_like(masks))


_mix.defvjp(_mix_fwd, _mix_bwd)


def _masks(same_segment, P: int):
    """[P', B, T] fp32 (P' = P rounded up to a power of two): row s-1 is same_segment[s]; None without segments."""
    if same_segment is None or P == 0:
        return None
    rows = [same_segment[s].astype(F32) for s in range(1, P + 1)]
    rows += [jnp.zeros_like(rows[0])] * (platform.next_pow2(P) - P)
    return jnp.stack(rows)


def qk_mix(xp, w1, b1, w2, b2, heads: int, same_segment=None, zero_halo: bool = False):
    P = _check(xp, w1, b1, w2, b2, heads, 0 if zero_halo else None)
    return _mix(xp, w1, b1, w2, b2, _masks(same_segment, P), int(heads), 0 if zero_halo else P)


def qk_mix_cached(x, ring, slot, w1, b1, w2, b2, heads: int):
    """zaya_jax.ops.cca_conv.qk_mix_cached in one kernel: x [B, T, C'] at cache slots slot .. slot + T - 1, a cache's
    ring [B, P + 1, C] -> (the mix, the ring including the chunk). Forward only (the inference programs)."""
    _check(x, w1, b1, w2, b2, heads, 0)
    slot = jnp.reshape(slot, (1,)).astype(jnp.int32)
    return tuple(_forward(x, w1, b1, w2, b2, None, heads=int(heads), off=0, ring=ring, slot=slot))


def _check(xp, w1, b1, w2, b2, heads: int, off: int | None) -> int:
    """The halo P, or a ValueError naming every shape problem; off: halo columns xp holds (None: P)."""
    B, Tp, width = xp.shape
    G, d, d_in, t1 = w2.shape
    C, t0 = G * d, w1.shape[1]
    P = halo(t0, t1)
    off = P if off is None else off
    problems = []
    if w1.shape != (C, t0) or b1.shape != (C,) or b2.shape != (C,) or d_in != d or width < C:
        problems.append(f"need w1 [C, t0], b1 [C], w2 [G, d, d, t1], b2 [C] with C = G * d <= {width} channels of xp; "
                        f"got w1 {w1.shape}, b1 {b1.shape}, w2 {w2.shape}, b2 {b2.shape}")
    if not 0 < heads < G or heads % (G - heads):
        problems.append(f"{heads} query heads of {G} heads: the rest ({G - heads}) must be KV heads dividing them")
    if d < 16 or d & (d - 1):
        problems.append(f"the head width {d} must be a power of two >= 16 (a Triton matmul tile)")
    if Tp <= off:
        problems.append(f"xp has {Tp} positions, not more than the {P} halo columns")
    if problems:
        raise ValueError("cca qk_mix (pallas): " + "; ".join(problems))
    return P

"""CCA's depthwise causal convolution taps as Pallas kernels (Triton lowering; interpret mode on the CPU), with a
custom VJP. Same contract and numerics as `zaya_jax.ops.cca_conv.depthwise_taps_reference`:

    depthwise_taps(xp [B, T + P, C], w1 [C, t0], b1 [C], t1, same_segment) -> t1 arrays [B, T, C] in xp.dtype

Forward: a program owns a [rows, channels] tile of every output tap; it reads each of the P + 1 shifted views of
its input rows once (they overlap, so most of it comes from cache) and adds it to every tap that uses it, in fp32,
rounded once. Backward: a program owns a tile of d xp rows u and reads the output-tap gradients at u - P + s for
every offset s, so one pass gives d xp and the tile's partial sums of d w1 (x . dy over its rows) and d b1; the
partials are summed afterwards in fp32. Shifted reads are row gathers clamped into the array and zeroed outside it (nothing is padded or copied);
the last tile's stores are masked. Inside shard_map (check_vma) the kernels run on inputs made varying over all
their axes, and the weight gradients are summed back to their primals' types (`_vma`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _platform
from pallas_kernels import _vma
from zaya_jax.ops.cca_conv import halo, tap_offset

F32 = jnp.float32

# (time rows, channels, warps) per program: the kernels are bandwidth-bound elementwise passes
_TILES = {"cuda": (64, 128, 8), "rocm": (64, 128, 4), "cpu": (16, 32, 4)}  # 256 lanes: 32 fp32 per tile


def _tiles(T: int, C: int):
    rows, chans, warps = _TILES[_platform.vendor()]
    bc = 1
    while bc * 2 <= chans and C % (bc * 2) == 0:  # a power of two dividing C: no channel padding
        bc *= 2
    return min(rows, max(16, _platform.next_pow2(T))), bc, warps


def _masks(same_segment, P: int, B: int):
    """[P', B, T] fp32 (P' = P rounded up to a power of two): row s-1 is same_segment[s]; None without segments."""
    if same_segment is None or P == 0:
        return None
    rows = [same_segment[s].astype(F32) for s in range(1, P + 1)]
    rows += [jnp.zeros_like(rows[0])] * (_platform.next_pow2(P) - P)
    return jnp.stack(rows)


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


# ------------------------------------------------------------------------------------------------------ forward
def _fwd_kernel(x_ref, w_ref, b_ref, *rest, t0, t1, P, T, rows, has_seg):
    m_ref = rest[0] if has_seg else None
    y_refs = rest[1:] if has_seg else rest
    start = pl.program_id(1) * rows
    acc = [jnp.broadcast_to(b_ref[...].astype(F32)[None, :], (rows, b_ref.shape[0])) for _ in range(t1)]
    for s in range(P + 1):  # each shifted input view read once, added to every tap that reads it
        col = _load_rows(x_ref, start + P - s, rows, T + P)
        if has_seg and s:
            col = col * _load_mask(m_ref, s, start, rows, T)
        for j in range(t1):
            for i in range(t0):
                if tap_offset(j, i, t0, t1) == s:
                    acc[j] = acc[j] + col * w_ref[i, :].astype(F32)[None, :]
    ok = jnp.broadcast_to(((start + jnp.arange(rows)) < T)[:, None], acc[0].shape)
    for j in range(t1):
        plgpu.store(y_refs[j].at[pl.ds(start, rows), :], acc[j].astype(y_refs[j].dtype), mask=ok)


def _tap_weights(w1):
    """[C, t0] -> [t0', C] fp32 (t0' = t0 rounded up to a power of two, a Triton block dimension)."""
    t0 = w1.shape[1]
    return jnp.pad(w1.astype(F32).T, ((0, _platform.next_pow2(t0) - t0), (0, 0)))


def _forward(xp, w1, b1, masks, *, t1: int, T: int):
    B, Tp, C = xp.shape
    t0 = w1.shape[1]
    P = Tp - T
    rows, bc, warps = _tiles(T, C)
    x, w, b, m = _vma.vary_to_union(xp, _tap_weights(w1), b1.astype(F32), masks)
    column = pl.BlockSpec((None, Tp, bc), lambda n, i, c: (n, 0, c))
    in_specs = [column, pl.BlockSpec((w.shape[0], bc), lambda n, i, c: (0, c)),
                pl.BlockSpec((bc,), lambda n, i, c: (c,))]
    args = [x, w, b]
    if m is not None:
        in_specs.append(pl.BlockSpec((m.shape[0], None, T), lambda n, i, c: (0, n, 0)))
        args.append(m)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, t0=t0, t1=t1, P=P, T=T, rows=rows, has_seg=m is not None),
        grid=(B, pl.cdiv(T, rows), C // bc),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, T, bc), lambda n, i, c: (n, 0, c))] * t1,
        out_shape=[_vma.out_struct((B, T, C), xp.dtype, x)] * t1,
        compiler_params=_platform.compiler_params(warps, 2),
        interpret=_platform.interpret(), name="cca_depthwise_fwd",
    )(*args)


# ----------------------------------------------------------------------------------------------------- backward
def _bwd_kernel(x_ref, w_ref, *rest, t0, t1, P, T, rows, has_seg):
    dy_refs, rest = rest[:t1], rest[t1:]
    m_ref = rest[0] if has_seg else None
    dx_ref, db_ref, *dw_refs = rest[1:] if has_seg else rest
    start = pl.program_id(1) * rows  # this program's rows u of d xp
    x = _load_rows(x_ref, start, rows, T + P)
    dx = jnp.zeros(x.shape, F32)
    dw = [jnp.zeros(x.shape[1:], F32) for _ in range(t0)]
    for j in range(t1):
        for i in range(t0):
            s = tap_offset(j, i, t0, t1)
            g = _load_rows(dy_refs[j], start - P + s, rows, T)  # dy_j at t = u - P + s
            if has_seg and s:
                g = g * _load_mask(m_ref, s, start - P + s, rows, T)
            dx = dx + g * w_ref[i, :].astype(F32)[None, :]
            dw[i] = dw[i] + jnp.sum(x * g, axis=0)
    db = jnp.zeros(x.shape[1:], F32)
    for j in range(t1):  # every output t once: rows t = u of each tap gradient
        db = db + jnp.sum(_load_rows(dy_refs[j], start, rows, T), axis=0)
    ok = (start + jnp.arange(rows)) < T + P
    plgpu.store(dx_ref.at[pl.ds(start, rows), :], dx.astype(dx_ref.dtype), mask=jnp.broadcast_to(ok[:, None], dx.shape))
    db_ref[...] = db
    for i in range(t0):
        dw_refs[i][...] = dw[i]


def _backward(xp, w1, masks, dys, *, T: int):
    B, Tp, C = xp.shape
    t0, t1 = w1.shape[1], len(dys)
    P = Tp - T
    rows, bc, warps = _tiles(T, C)
    nU = pl.cdiv(Tp, rows)
    x, w, m, *g = _vma.vary_to_union(xp, _tap_weights(w1), masks, *dys)
    in_specs = ([pl.BlockSpec((None, Tp, bc), lambda n, i, c: (n, 0, c)),
                 pl.BlockSpec((w.shape[0], bc), lambda n, i, c: (0, c))]
                + [pl.BlockSpec((None, T, bc), lambda n, i, c: (n, 0, c))] * t1)
    args = [x, w, *g]
    if m is not None:
        in_specs.append(pl.BlockSpec((m.shape[0], None, T), lambda n, i, c: (0, n, 0)))
        args.append(m)
    part = pl.BlockSpec((None, None, bc), lambda n, i, c: (n, i, c))
    outs = pl.pallas_call(
        functools.partial(_bwd_kernel, t0=t0, t1=t1, P=P, T=T, rows=rows, has_seg=m is not None),
        grid=(B, nU, C // bc),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, Tp, bc), lambda n, i, c: (n, 0, c))] + [part] * (1 + t0),
        out_shape=[_vma.out_struct((B, Tp, C), xp.dtype, x)] + [_vma.out_struct((B, nU, C), F32, x)] * (1 + t0),
        compiler_params=_platform.compiler_params(warps, 2),
        interpret=_platform.interpret(), name="cca_depthwise_bwd",
    )(*args)
    return outs[0], jnp.stack([p.sum(axis=(0, 1)) for p in outs[2:]], axis=1), outs[1].sum(axis=(0, 1))


# -------------------------------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _taps(xp, w1, b1, masks, t1):
    return tuple(_forward(xp, w1, b1, masks, t1=t1, T=xp.shape[1] - halo(w1.shape[1], t1)))


def _taps_fwd(xp, w1, b1, masks, t1):
    return _taps(xp, w1, b1, masks, t1), (xp, w1, b1, masks)


def _taps_bwd(t1, res, dys):
    xp, w1, b1, masks = res
    dx, dw, db = _backward(xp, w1, masks, list(dys), T=dys[0].shape[1])
    return (_vma.sum_to_type_of(dx, xp), _vma.sum_to_type_of(dw.astype(w1.dtype), w1),
            _vma.sum_to_type_of(db.astype(b1.dtype), b1), None if masks is None else jnp.zeros_like(masks))


_taps.defvjp(_taps_fwd, _taps_bwd)


def depthwise_taps(xp, w1, b1, t1: int, same_segment=None):
    t0 = w1.shape[1]
    P = halo(t0, t1)
    B, Tp, C = xp.shape
    if w1.shape[0] != C or b1.shape != (C,) or Tp <= P:
        raise ValueError(f"depthwise_taps: need xp [B, T + {P}, C], w1 [C, {t0}], b1 [C]; got {xp.shape}, "
                         f"{w1.shape}, {b1.shape}")
    return list(_taps(xp, w1, b1, _masks(same_segment, P, B), int(t1)))

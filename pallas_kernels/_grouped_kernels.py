"""Grouped-GEMM kernels of the MoE experts (Pallas, Triton lowering): forward / dgrad, and wgrad.

Layout (built by `zaya_jax.ops.grouped_matmul.tile_layout`): rows sorted by group and every group padded to a whole
number of `bm`-row units, so each unit belongs to one group. Weights are stored [E, out, in] as in PyTorch / the HF
checkpoint.

  rows_matmul  'nt': y[tile] = x[tile] @ w[g]ᵀ   (contract w's `in`: the forward)
               'nn': y[tile] = x[tile] @ w[g]    (contract w's `out`: the data gradient)
               'nt' with src: x holds tokens and a tile's rows are loaded as x[src[row]] (zeros where src is out
               of range), so the layout's row gather is not a pass of its own
               a program's tile is up to `span` consecutive units of one group g (a group's last tile may have
               fewer); the units past the last group (g = E) get zero rows.
  group_wgrad  dw[e] = dy[rows of e]ᵀ @ x[rows of e]  ->  [E, out, in]; a group without units gets zeros.

Shapes must be whole tiles (the public wrapper pads): rows % bm == 0, every other dimension a multiple of the block
that walks it. Accumulation is fp32; outputs are in the input dtype. All operands are whole-array refs indexed with
pl.ds, because the expert and rows of a tile are only known inside the kernel (read from the tile tables).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform, vma

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b


def swizzled_tile(p, num_row_tiles: int, num_col_tiles: int, group_rows: int):
    """Program p -> (row tile, column tile), column-major inside bands of `group_rows` row tiles.

    Programs that run together then cover a few row tiles (about one or two experts) times many column tiles: the
    rows of x stay in L2 across the band, and the consecutive row tiles of one expert read the same weight tile, so
    each expert's weights come from HBM about once instead of once per row tile."""
    width = group_rows * num_col_tiles
    band = lax.div(p, width)
    first = band * group_rows
    rows_here = jnp.minimum(num_row_tiles - first, group_rows)
    within = lax.rem(p, width)
    return first + lax.rem(within, rows_here), lax.div(within, rows_here)


# ------------------------------------------------------------------------------------------- forward / dgrad
def _rows_kernel(unit_ref, group_ref, units_ref, *refs, bm, span, bn, bk, k_steps, num_tiles, num_col_tiles,
                 group_rows, num_groups, transpose_w, precision, num_tokens):
    src_ref, (x_ref, w_ref, o_ref) = (refs[0], refs[1:]) if num_tokens is not None else (None, refs)
    tile, col = swizzled_tile(pl.program_id(0), num_tiles, num_col_tiles, group_rows)
    g = group_ref[tile]
    n = units_ref[tile]
    first = pl.multiple_of(unit_ref[tile] * bm, bm)
    cols = pl.ds(pl.multiple_of(col * bn, bn), bn)

    def compute(rows, m):
        if src_ref is not None:
            src = src_ref[rows]
            held = src < num_tokens
            src = jnp.where(held, src, 0)[:, None]

        def step(k, acc):
            ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
            if src_ref is None:
                a = x_ref[rows, ks]
            else:  # index arrays on both axes (Pallas takes no array index next to a slice)
                a = plgpu.load(x_ref.at[src, (k * bk + jnp.arange(bk))[None, :]], mask=held[:, None], other=0)
            if transpose_w:
                return acc + lax.dot_general(a, w_ref[g, cols, ks], _NT, precision=precision,
                                             preferred_element_type=F32)
            return acc + lax.dot_general(a, w_ref[g, ks, cols], _NN, precision=precision, preferred_element_type=F32)

        acc = lax.fori_loop(0, k_steps, step, jnp.zeros((m, bn), F32))
        o_ref[rows, cols] = acc.astype(o_ref.dtype)

    def idle(rows, m):  # the units past the last group: defined zeros (outputs are not zero-initialised)
        o_ref[rows, cols] = jnp.zeros((m, bn), o_ref.dtype)

    for u in range(1, span + 1):  # one branch per tile height: a group's last tile may be shorter
        rows = pl.ds(first, u * bm)
        pl.when((n == u) & (g < num_groups))(functools.partial(compute, rows, u * bm))
        pl.when((n == u) & (g >= num_groups))(functools.partial(idle, rows, u * bm))


def rows_matmul(x, w, tiles, *, transpose_w: bool, block_rows: int, span: int, block_n: int, block_k: int,
                group_rows: int, num_warps: int, num_stages: int, interpret: bool, src=None):
    """'nt' (transpose_w=True): x [M, in] -> [M, out]; 'nn': x [M, out] -> [M, in]. w [E, out, in]. With src [M]
    ('nt' only): x [N, in] holds tokens and row r is read as x[src[r]] (zero where src[r] >= N).

    tiles [3, W] int32: each program's first row unit, group and number of units (<= span; 0: nothing), from
    pallas_kernels.grouped_matmul.program_tiles."""
    if src is not None and not transpose_w:
        raise ValueError("rows_matmul: gathered rows (src) are for the 'nt' forward only")
    M, K = (x.shape[0] if src is None else src.shape[0]), x.shape[1]
    E = w.shape[0]
    W = tiles.shape[1]
    n_out = w.shape[1] if transpose_w else w.shape[2]
    contract = w.shape[2] if transpose_w else w.shape[1]
    if M % block_rows or K != contract or n_out % block_n or K % block_k or tiles.shape[0] != 3:
        raise ValueError(f"rows_matmul: x {x.shape}, w {w.shape}, tiles {tiles.shape}, rows {block_rows}, blocks "
                         f"({block_n}, {block_k}) do not tile (transpose_w={transpose_w})")
    num_col_tiles = n_out // block_n
    kernel = functools.partial(
        _rows_kernel, bm=block_rows, span=span, bn=block_n, bk=block_k, k_steps=K // block_k, num_tiles=W,
        num_col_tiles=num_col_tiles, group_rows=group_rows, num_groups=E, transpose_w=transpose_w,
        precision=platform.dot_precision(x.dtype), num_tokens=None if src is None else x.shape[0])
    return pl.pallas_call(
        kernel,
        out_shape=vma.out_struct((M, n_out), x.dtype, x),
        grid=(W * num_col_tiles,),
        compiler_params=platform.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=("grouped_matmul_nt" if src is None else "grouped_matmul_nt_gathered") if transpose_w else
        "grouped_matmul_nn",
    )(tiles[0], tiles[1], tiles[2], *([] if src is None else [src]), x, w)


# ------------------------------------------------------------------------------------------------------ wgrad
def _wgrad_kernel(start_ref, count_ref, *refs, parts, bm, rows_step, bn, bk, num_n_tiles, num_k_tiles, precision,
                  has_base):
    """dw[e] tile = (base[e] tile +) the sum over `parts` (dy, x) pairs of dy[rows of e]ᵀ x[rows of e], one fp32
    register sum for all of them: a part's loop runs over its layout's tiles of expert e (start/count row `part`)."""
    dy_refs, x_refs = refs[:parts], refs[parts:2 * parts]
    base_ref, o_ref = (refs[2 * parts], refs[2 * parts + 1]) if has_base else (None, refs[2 * parts])
    p = pl.program_id(0)
    per_group = num_n_tiles * num_k_tiles
    e = lax.div(p, per_group)
    within = lax.rem(p, per_group)  # k fastest: neighbouring programs share the same dy column block
    cols = pl.ds(pl.multiple_of(lax.div(within, num_k_tiles) * bn, bn), bn)
    ks = pl.ds(pl.multiple_of(lax.rem(within, num_k_tiles) * bk, bk), bk)
    acc = jnp.zeros((bn, bk), F32)
    for part in range(parts):
        first_row = start_ref[part, e] * bm
        steps = count_ref[part, e] * (bm // rows_step)  # dynamic trip count: this group's rows only; 0 if empty

        def step(i, acc, dy_ref=dy_refs[part], x_ref=x_refs[part], first_row=first_row):
            r = pl.ds(pl.multiple_of(first_row + i * rows_step, rows_step), rows_step)
            return acc + lax.dot_general(dy_ref[r, cols], x_ref[r, ks], _TN, precision=precision,
                                         preferred_element_type=F32)

        acc = lax.fori_loop(0, steps, step, acc)
    if has_base:
        acc = acc + base_ref[e, cols, ks]
    o_ref[e, cols, ks] = acc.astype(o_ref.dtype)


def group_wgrad(dys, xs, group_tile_start, group_tile_count, *, block_rows: int, block_n: int, block_k: int,
                rows_step: int, num_warps: int, num_stages: int, interpret: bool, base=None):
    """dys [M, out] and xs [M, in] (one pair per part, each on its own layout), per-part first tile and tile count of
    every group [parts, E] -> dw [E, out, in] = sum over parts of dy[rows of e]ᵀ x[rows of e], in x's dtype; with
    base [E, out, in] fp32: base + that sum, in fp32, written in place of base (its buffer is donated)."""
    dys, xs = tuple(dys), tuple(xs)
    parts = len(dys)
    M, n_out = dys[0].shape
    K = xs[0].shape[1]
    E = group_tile_start.shape[1]
    shapes_ok = (len(xs) == parts and all(d.shape == (M, n_out) for d in dys) and all(x.shape == (M, K) for x in xs)
                 and group_tile_start.shape == group_tile_count.shape == (parts, E))
    if not shapes_ok or M % block_rows or block_rows % rows_step or n_out % block_n or K % block_k:
        raise ValueError(f"group_wgrad: dy {[d.shape for d in dys]}, x {[x.shape for x in xs]}, starts "
                         f"{group_tile_start.shape}, rows {block_rows}/{rows_step}, blocks ({block_n}, {block_k}) do "
                         f"not tile")
    if base is not None and (base.shape != (E, n_out, K) or base.dtype != F32):
        raise ValueError(f"group_wgrad: base must be fp32 [{E}, {n_out}, {K}], got {base.dtype} {base.shape}")
    kernel = functools.partial(
        _wgrad_kernel, parts=parts, bm=block_rows, rows_step=rows_step, bn=block_n, bk=block_k,
        num_n_tiles=n_out // block_n, num_k_tiles=K // block_k, precision=platform.dot_precision(xs[0].dtype),
        has_base=base is not None)
    args = [group_tile_start, group_tile_count, *dys, *xs] + ([] if base is None else [base])
    return pl.pallas_call(
        kernel,
        out_shape=vma.out_struct((E, n_out, K), xs[0].dtype if base is None else F32, xs[0]),
        grid=(E * (n_out // block_n) * (K // block_k),),
        input_output_aliases={} if base is None else {len(args) - 1: 0},
        compiler_params=platform.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="grouped_matmul_wgrad" if base is None else "grouped_matmul_wgrad_sum",
    )(*args)

"""Grouped GEMM of the MoE experts on a tile-padded layout, with its custom VJP (Pallas, Triton lowering).

    grouped_matmul(x [M, in], w [E, out, in], tile_group [T]) -> y [M, out],
    y[unit t] = x[unit t] @ w[tile_group[t]]ᵀ, zero rows for idle units (tile_group[t] == E).

M = T * block_rows: the layout (zaya_jax.ops.grouped_matmul.tile_layout) sorts tokens by expert and pads every
expert's rows to whole `block_rows` units, so a unit never straddles two experts. A forward program computes up to
program_rows / block_rows units of one expert (one weight read for a tall tile); an expert's last tile takes only its
remaining units. Compared with lax.ragged_dot (which XLA lowers on GPU to a dense dot over all experts, masked) the
work is the useful work plus the padding of each expert's last unit (< E * block_rows rows): short units keep the
padding small, tall program tiles keep the GEMMs fast.

Given the layout's row maps, the forward reads its rows from token order (no gathered copy of the tokens written
first); its backward gathers that copy for the weight gradient and returns dx in token order.

Backward: dx = dy @ w[g] per tile (the same kernel contracting w's `out` axis) and dw[e] = dy[rows of e]ᵀ x[rows of e]
(a kernel per (expert, output tile) that loops over that expert's units only). Dimensions that are not whole
tiles are zero-padded here (zero columns add nothing to a contraction; extra output columns are cut off); ZAYA1's
widths need no padding. fp32 accumulation throughout; outputs (dx, dw too) are in the input dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _grouped_kernels as kern
from pallas_kernels import platform, vma


@dataclasses.dataclass(frozen=True)
class GroupedTiling:
    """Tile sizes and Triton launch parameters of the three kernels.

    block_rows is the layout's row unit (each expert's rows are padded to a multiple of it), shared by all three.
    program_rows: rows of a forward / dgrad program's tile (a multiple of block_rows; an expert's last tile may be
    shorter by whole units). fwd_* / dgrad_*: output columns per program (n), contraction step (k); group_rows:
    program tiles per L2 band. wgrad_*: output tile (n x k) of dw[e] per program, rows per contraction step (divides
    block_rows)."""

    # 128-row program tiles run the GEMMs faster than 64 (H200 sweeps); 64-row units halve each expert's padding.
    block_rows: int = 64
    program_rows: int = 128
    group_rows: int = 8
    # From the H200 sweeps: 256-column forward tiles beat 128, then 4 stages for the forward, a 256 x 64 dgrad tile
    # with 4 stages and a 128 x 256 wgrad tile were fastest; 128-row wgrad steps were slower (docs/experiments.md).
    fwd_n: int = 256
    fwd_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 4
    dgrad_n: int = 256
    dgrad_k: int = 64
    dgrad_warps: int = 8
    dgrad_stages: int = 4
    wgrad_n: int = 128
    wgrad_k: int = 256
    wgrad_rows: int = 64
    wgrad_warps: int = 8
    wgrad_stages: int = 3

    def fitted(self, n_in: int, n_out: int) -> GroupedTiling:
        """Tiles no wider than the (power-of-two rounded) matrix, never below 16 (Triton's smallest dot)."""
        def fit(block, n):
            return max(16, min(block, platform.next_pow2(n)))
        return dataclasses.replace(
            self, fwd_n=fit(self.fwd_n, n_out), fwd_k=fit(self.fwd_k, n_in), dgrad_n=fit(self.dgrad_n, n_in),
            dgrad_k=fit(self.dgrad_k, n_out), wgrad_n=fit(self.wgrad_n, n_out), wgrad_k=fit(self.wgrad_k, n_in))


_OVERRIDE: dict = {}  # fields replaced in default_tiling's result (tiling_override)


@contextlib.contextmanager
def tiling_override(**fields):
    """Kernels traced inside use the default tiling with these fields replaced (benchmarks A/B tilings in one
    process; tracing is where the tiling is read)."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(GroupedTiling)}
    if unknown:
        raise ValueError(f"tiling_override: {sorted(unknown)} are not GroupedTiling fields")
    saved = dict(_OVERRIDE)
    _OVERRIDE.clear()
    _OVERRIDE.update(fields)
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(saved)


def default_tiling(dtype) -> GroupedTiling:
    return dataclasses.replace(_default_tiling(dtype), **_OVERRIDE)


def _default_tiling(dtype) -> GroupedTiling:
    vendor = platform.vendor()
    # interpret mode: small tiles keep the interpreter quick and exercise several tiles; one unit per program (each
    # tile height is another branch to trace: the kernel tests run two-unit tiles)
    if vendor == "cpu":
        return GroupedTiling(block_rows=16, program_rows=16, group_rows=2, fwd_n=16, fwd_k=16, fwd_warps=4,
                             fwd_stages=1, dgrad_n=16, dgrad_k=16, dgrad_warps=4, dgrad_stages=1, wgrad_n=16,
                             wgrad_k=16, wgrad_rows=16, wgrad_warps=4, wgrad_stages=1)
    tiling = GroupedTiling()
    if jnp.dtype(dtype).itemsize >= 4:  # fp32 tiles take twice the shared memory per stage
        tiling = dataclasses.replace(tiling, program_rows=64, fwd_n=64, fwd_k=32, fwd_warps=4, dgrad_n=64, dgrad_k=32,
                                     dgrad_warps=4, wgrad_n=64, wgrad_k=64, wgrad_rows=32, wgrad_warps=4)
    if vendor == "rocm":  # 64-lane wavefronts: half the warps for as many lanes; AMD's pipeliner wants <= 2 stages
        tiling = dataclasses.replace(
            tiling, fwd_warps=max(1, tiling.fwd_warps // 2), fwd_stages=min(2, tiling.fwd_stages),
            dgrad_warps=max(1, tiling.dgrad_warps // 2), dgrad_stages=min(2, tiling.dgrad_stages),
            wgrad_warps=max(1, tiling.wgrad_warps // 2), wgrad_stages=min(2, tiling.wgrad_stages))
    return tiling


def group_tiles(tile_group, num_groups: int):
    """(first tile, number of tiles) of every group, from the non-decreasing tile -> group map."""
    count = jnp.bincount(tile_group, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    return jnp.cumsum(count) - count, count


def program_tiles(tile_group, num_groups: int, span: int):
    """The forward / dgrad programs' tiles, [3, W] int32: first unit, group, number of units. Each group's units
    run `span` at a time (its last tile takes the rest); then the units past the last group (group E, zeroed), `span`
    at a time; programs left over get 0 units. W = ceil(T / span) + E bounds sum_e ceil(count_e / span) + the idle
    tiles for any routing."""
    T = tile_group.shape[0]
    E = num_groups
    start, count = group_tiles(tile_group, E)
    per_group = -(-count // span)
    end = jnp.cumsum(per_group)
    j = jnp.arange(-(-T // span) + E, dtype=jnp.int32)
    g = jnp.searchsorted(end, j, side="right").astype(jnp.int32)  # E past the last group's tiles
    gc = jnp.minimum(g, E - 1)
    local = (j - (end - per_group)[gc]) * span
    idle_first = jnp.sum(count) + (j - end[-1]) * span
    busy = g < E
    first = jnp.where(busy, start[gc] + local, jnp.minimum(idle_first, T - 1))
    units = jnp.where(busy, jnp.minimum(span, count[gc] - local), jnp.clip(T - idle_first, 0, span))
    return jnp.stack([first, g, units]).astype(jnp.int32)


def units_per_tile(t: GroupedTiling, unit: int) -> int:
    """Units per program tile: program_rows / unit when that is whole, else 1 (a layout built on another unit)."""
    return t.program_rows // unit if t.program_rows % unit == 0 else 1


# ----------------------------------------------------------------------------------------- the custom VJP
def _rows(x, w, tile_group, tiles, t: GroupedTiling, interpret: bool, transpose_w: bool, src=None):
    unit = (x.shape[0] if src is None else src.shape[0]) // tile_group.shape[0]
    n, k, warps, stages = ((t.fwd_n, t.fwd_k, t.fwd_warps, t.fwd_stages) if transpose_w else
                           (t.dgrad_n, t.dgrad_k, t.dgrad_warps, t.dgrad_stages))
    return kern.rows_matmul(x, w, tiles, transpose_w=transpose_w, block_rows=unit, span=units_per_tile(t, unit),
                            block_n=n, block_k=k, group_rows=t.group_rows, num_warps=warps, num_stages=stages,
                            interpret=interpret, src=src)


def _wgrad(dy, x, tile_group, num_groups: int, t: GroupedTiling, interpret: bool):
    start, count = group_tiles(tile_group, num_groups)
    return kern.group_wgrad([dy], [x], start[None], count[None], block_rows=x.shape[0] // tile_group.shape[0],
                            block_n=t.wgrad_n, block_k=t.wgrad_k, rows_step=t.wgrad_rows, num_warps=t.wgrad_warps,
                            num_stages=t.wgrad_stages, interpret=interpret)


# Inside shard_map (check_vma) a kernel's inputs must share one type: invariant ones (e.g. replicated weights)
# are made varying like the tokens, and their gradients summed back over those axes in the backward.
# The program tiles (program_tiles) are built once per call and serve the forward and the data gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm(x, w, tile_group, tiles, tiling, interpret):
    return _rows(*vma.vary_to_union(x, w, tile_group, tiles), tiling, interpret, transpose_w=True)


def _gmm_fwd(x, w, tile_group, tiles, tiling, interpret):
    return _gmm(x, w, tile_group, tiles, tiling, interpret), (x, w, tile_group, tiles)


def _gmm_bwd(tiling, interpret, res, dy):
    x, w, tile_group, tiles = res
    xv, wv, tgv, tv, dy = vma.vary_to_union(x, w, tile_group, tiles, dy.astype(x.dtype))
    dx = _rows(dy, wv, tgv, tv, tiling, interpret, transpose_w=False)
    dw = _wgrad(dy, xv, tgv, w.shape[0], tiling, interpret)
    return vma.sum_to_type_of(dx, x), vma.sum_to_type_of(dw, w), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# The forward reading its rows from token order (x [N, in], row r = x[src[r]]): no gathered copy of the tokens is
# written and read back. The backward gathers that copy (the weight gradient's operand) and takes the data gradient
# back to token order by dst, the inverse map, so its work is the ungathered path's backward plus one gather.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _gmm_gathered(x, src, dst, w, tile_group, tiles, tiling, interpret):
    xv, sv, wv, tgv, tv = vma.vary_to_union(x, src, w, tile_group, tiles)
    return _rows(xv, wv, tgv, tv, tiling, interpret, transpose_w=True, src=sv)


def _gmm_gathered_fwd(x, src, dst, w, tile_group, tiles, tiling, interpret):
    return _gmm_gathered(x, src, dst, w, tile_group, tiles, tiling, interpret), (x, src, dst, w, tile_group, tiles)


def _gmm_gathered_bwd(tiling, interpret, res, dy):
    x, src, dst, w, tile_group, tiles = res
    xs = jnp.take(x, src, axis=0, mode="fill", fill_value=0)
    dxs, dw, _, _ = _gmm_bwd(tiling, interpret, (xs, w, tile_group, tiles), dy)
    dx = jnp.take(dxs, dst, axis=0, mode="fill", fill_value=0)
    return vma.sum_to_type_of(dx, x), None, None, dw, None, None


_gmm_gathered.defvjp(_gmm_gathered_fwd, _gmm_gathered_bwd)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def grouped_matmul(x, w, tile_group, *, tiling: GroupedTiling | None = None, interpret: bool | None = None,
                   src=None, dst=None):
    """x [T * block_rows, in], w [E, out, in], tile_group [T] int32 non-decreasing in [0, E] -> [T * block_rows, out].
    With src [T * block_rows] and dst [N] (the layout's maps, zaya_jax.ops.grouped_matmul.tile_layout), x [N, in]
    holds the tokens: the result is that of x[src] (zero rows where src is out of range), read in place.

    Differentiable in x and w. The row unit is the rows over T (the layout's); `tiling.block_rows` is what the
    layout should have been built with and is not consulted here."""
    if (src is None) != (dst is None):
        raise ValueError("grouped_matmul: gathered rows need both maps, src and dst")
    rows = x.shape[0] if src is None else src.shape[0]
    if x.ndim != 2 or w.ndim != 3 or tile_group.ndim != 1:
        raise ValueError(f"grouped_matmul needs x [M, in], w [E, out, in], tile_group [T]; got {x.shape}, {w.shape}, "
                         f"{tile_group.shape}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_matmul: x has {x.shape[1]} input features, w {w.shape} expects {w.shape[2]}")
    if rows % tile_group.shape[0]:
        raise ValueError(f"grouped_matmul: {rows} rows are not {tile_group.shape[0]} whole tiles")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul: x is {x.dtype} but w is {w.dtype}; cast to one compute dtype")
    n_in, n_out = w.shape[2], w.shape[1]
    unit = rows // tile_group.shape[0]
    if unit % 16:
        raise ValueError(f"grouped_matmul: the row unit {unit} must be a multiple of 16")
    t = (tiling or default_tiling(x.dtype)).fitted(n_in, n_out)
    # the wgrad row step must divide the row unit (both multiples of 16, the step a power of two)
    t = dataclasses.replace(t, wgrad_rows=math.gcd(t.wgrad_rows, unit))
    interpret = platform.interpret() if interpret is None else interpret
    in_multiple = max(t.fwd_k, t.dgrad_n, t.wgrad_k)  # every block that walks `in` divides it (powers of two)
    out_multiple = max(t.fwd_n, t.dgrad_k, t.wgrad_n)
    xp = platform.pad_to_multiple(x, 1, in_multiple)
    wp = platform.pad_to_multiple(platform.pad_to_multiple(w, 2, in_multiple), 1, out_multiple)
    tile_group = tile_group.astype(jnp.int32)
    tiles = program_tiles(tile_group, w.shape[0], units_per_tile(t, unit))
    if src is None:
        y = _gmm(xp, wp, tile_group, tiles, t, interpret)
    else:
        y = _gmm_gathered(xp, src.astype(jnp.int32), dst.astype(jnp.int32), wp, tile_group, tiles, t, interpret)
    return y[:, :n_out]


def grouped_wgrad_sum(total, dys, xs, tile_groups, *, tiling: GroupedTiling | None = None,
                      interpret: bool | None = None):
    """total [E, out, in] fp32 + sum over parts i of the weight gradient of grouped_matmul(xs[i], w, tile_groups[i])
    under the output gradient dys[i] (dy[rows of e]ᵀ x[rows of e] per expert e), every part on its own layout.

    One kernel for all parts (one fp32 register sum per output tile, added to total in place: total's buffer is
    donated when the caller's jit allows): k microbatches' expert gradients without k gradients in the compute
    dtype written and read back. xs / dys share one shape each (padded rows of one layout size)."""
    dys, xs, tile_groups = tuple(dys), tuple(xs), tuple(tile_groups)
    if not dys or not (len(dys) == len(xs) == len(tile_groups)):
        raise ValueError(f"grouped_wgrad_sum: needs as many dys, xs and tile_groups (>= 1), got {len(dys)}, "
                         f"{len(xs)}, {len(tile_groups)}")
    E, n_out, n_in = total.shape
    if any(x.shape[1] != n_in for x in xs) or any(d.shape[1] != n_out for d in dys):
        raise ValueError(f"grouped_wgrad_sum: total {total.shape} does not match x {xs[0].shape} / dy {dys[0].shape}")
    t = (tiling or default_tiling(xs[0].dtype)).fitted(n_in, n_out)
    bm = xs[0].shape[0] // tile_groups[0].shape[0]
    t = dataclasses.replace(t, wgrad_rows=math.gcd(t.wgrad_rows, bm))
    interpret = platform.interpret() if interpret is None else interpret
    if n_in % t.wgrad_k or n_out % t.wgrad_n:
        raise ValueError(f"grouped_wgrad_sum: [{n_out}, {n_in}] is not whole ({t.wgrad_n}, {t.wgrad_k}) tiles")
    tiles = [group_tiles(tg.astype(jnp.int32), E) for tg in tile_groups]
    start = jnp.stack([s for s, _ in tiles])
    count = jnp.stack([c for _, c in tiles])
    args = vma.vary_to_union(total.astype(jnp.float32), start, count, *dys, *xs)
    total, start, count, rest = args[0], args[1], args[2], args[3:]
    return kern.group_wgrad(rest[:len(dys)], rest[len(dys):], start, count, block_rows=bm, block_n=t.wgrad_n,
                            block_k=t.wgrad_k, rows_step=t.wgrad_rows, num_warps=t.wgrad_warps,
                            num_stages=t.wgrad_stages, interpret=interpret, base=total)


__all__ = ["GroupedTiling", "default_tiling", "group_tiles", "grouped_matmul", "grouped_wgrad_sum", "program_tiles",
           "units_per_tile"]

"""Grouped GEMM of the top-1 MoE on a tile-padded layout: the layout, the row permutations, the jnp reference.

Layout for `block_rows` = bm: tokens sorted by group (expert); each group's rows padded up to a multiple of bm, so
every row tile of the padded matrix belongs to one group. The padded length is static: at most
N + E*(bm-1) rows are needed, rounded up to whole tiles; tiles past the last group are idle (group E).

    src [Np]     token that fills each padded row; N (out of range) for padding rows, which read as zeros
    dst [N]      padded row of each token; Np (out of range) for tokens routed to the skip class E
    tile_group [T]  group of each row tile, non-decreasing, E for idle tiles

Rows move by gathers in both directions (`gather_rows`): the backward of "gather by src" is "gather by dst" and
vice versa, because the two index maps are inverse bijections between routed tokens and real padded rows. So no
activation-sized scatter appears in the forward or the backward.

grouped_matmul(x [Np, in], w [E, out, in], tile_group) -> [Np, out]: y[tile t] = x[tile t] @ w[g(t)]ᵀ, zero rows for
idle tiles; impl 'xla' is the jnp reference below (tests, small shapes), 'pallas' the kernels in
pallas_kernels.grouped_matmul (Triton on GPU, interpret mode on the CPU).

Deferred weight gradient (`DeferredWgrad`, for gradient accumulation): w may come wrapped with three zero "taps" that
the forward ignores. Differentiated, the weight's cotangent is left zero and the taps' cotangents carry what its
gradient needs instead: the layer's input rows x, its output gradient dy and the tile -> expert map. The caller adds
the weight gradients of several microbatches to an fp32 sum with one kernel (`grouped_wgrad_sum`): no per-microbatch
gradient in the compute dtype written, read back and added.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.vma import sum_to_type_of


class TileLayout(NamedTuple):
    src: jax.Array  # [Np] int32
    dst: jax.Array  # [N] int32
    tile_group: jax.Array  # [T] int32


def padded_rows(num_tokens: int, num_groups: int, block_rows: int) -> int:
    """Static padded length: enough whole tiles for any routing of num_tokens tokens over num_groups groups."""
    return -(-(num_tokens + num_groups * (block_rows - 1)) // block_rows) * block_rows


def tile_layout(index, num_groups: int, block_rows: int) -> TileLayout:
    """index [N] int in [0, num_groups] (num_groups = skip: the token gets no row) -> TileLayout."""
    if index.ndim != 1:
        raise ValueError(f"tile_layout needs a flat [N] index, got shape {index.shape}")
    if block_rows <= 0:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    n = index.shape[0]
    E, bm = num_groups, block_rows
    n_pad = padded_rows(n, E, bm)
    index = jnp.clip(index.astype(jnp.int32), 0, E)
    onehot = jax.nn.one_hot(index, E + 1, dtype=jnp.int32)
    sizes = onehot.sum(axis=0)[:E]
    # rank of each token among the tokens of its group, in token order (a stable sort without sorting)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), index[:, None], axis=1)[:, 0] - 1
    tiles = -(-sizes // bm)
    tile_end = jnp.cumsum(tiles)
    first_row = (tile_end - tiles) * bm  # [E]
    routed = index < E
    dst = jnp.where(routed, first_row[jnp.minimum(index, E - 1)] + rank, n_pad).astype(jnp.int32)
    # src is the inverse of dst on the routed tokens; an integer scatter of N indices (the activations only gather)
    src = jnp.full((n_pad,), n, jnp.int32).at[dst].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    tile_group = jnp.searchsorted(tile_end, jnp.arange(n_pad // bm, dtype=tile_end.dtype), side="right")
    return TileLayout(src=src, dst=dst, tile_group=tile_group.astype(jnp.int32))


@jax.custom_vjp
def gather_rows(x, rows, inverse_rows):
    """x[rows] with zero rows where rows is out of range; `inverse_rows` must invert `rows` on its in-range
    entries (and be out of range elsewhere): the backward is the gather of the cotangent by `inverse_rows`."""
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _gather_fwd(x, rows, inverse_rows):
    # x[:0]: an empty stand-in that keeps x's type (its varying mesh axes) for the backward
    return gather_rows(x, rows, inverse_rows), (x[:0], inverse_rows)


def _gather_bwd(res, dy):
    x_type, inverse_rows = res
    dx = jnp.take(dy, inverse_rows, axis=0, mode="fill", fill_value=0)
    return sum_to_type_of(dx, x_type), None, None


gather_rows.defvjp(_gather_fwd, _gather_bwd)


def grouped_matmul_reference(x, w, tile_group):
    """Per-tile weight gather and a batched GEMM (exact, [T, out, in] of memory: for tests and small shapes)."""
    E = w.shape[0]
    T = tile_group.shape[0]
    bm = x.shape[0] // T
    wt = w[jnp.minimum(tile_group, E - 1)]
    y = jnp.einsum("tmk,tok->tmo", x.reshape(T, bm, x.shape[1]), wt, preferred_element_type=x.dtype)
    y = jnp.where((tile_group < E)[:, None, None], y, jnp.zeros((), y.dtype))
    return y.reshape(x.shape[0], w.shape[1])


class DeferredWgrad(NamedTuple):
    """An expert weight whose gradient is deferred (see the module doc). The taps are zeros whose cotangents are
    x [Np, in], dy [Np, out] (the compute dtype) and the tile -> expert map [T] (as fp32: exact small integers)."""
    weight: jax.Array  # [E, out, in]
    x: jax.Array
    dy: jax.Array
    tiles: jax.Array

    @property
    def shape(self):
        return self.weight.shape

    @property
    def dtype(self):
        return self.weight.dtype


def defer_wgrad(weight, num_tokens: int, block_rows: int, dtype=None) -> DeferredWgrad:
    """weight [E, out, in] with zero taps for a layer of num_tokens tokens on `block_rows`-row tiles."""
    E, n_out, n_in = weight.shape
    rows = padded_rows(num_tokens, E, block_rows)
    dtype = weight.dtype if dtype is None else dtype
    return DeferredWgrad(weight, jnp.zeros((rows, n_in), dtype), jnp.zeros((rows, n_out), dtype),
                         jnp.zeros((rows // block_rows,), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _deferred(x, w, tile_group, tap_x, tap_dy, tap_tiles, impl, tiling):
    return grouped_matmul(x, w, tile_group, impl=impl, tiling=tiling)


def _deferred_fwd(x, w, tile_group, tap_x, tap_dy, tap_tiles, impl, tiling):
    return _deferred(x, w, tile_group, tap_x, tap_dy, tap_tiles, impl, tiling), (x, w, tile_group)


def _deferred_bwd(impl, tiling, res, dy):
    x, w, tile_group = res
    # the data gradient alone: the weight-gradient kernel of this VJP has no consumer and is removed by XLA
    _, pull = jax.vjp(lambda x_: grouped_matmul(x_, w, tile_group, impl=impl, tiling=tiling), x)
    dy = dy.astype(x.dtype)
    return pull(dy)[0], jnp.zeros_like(w), None, x, dy, tile_group.astype(jnp.float32)


_deferred.defvjp(_deferred_fwd, _deferred_bwd)


def grouped_matmul(x, w, tile_group, *, impl: str = "xla", tiling=None, layout: TileLayout | None = None):
    """`tiling` (a pallas_kernels.grouped_matmul.GroupedTiling, 'pallas' only) overrides the default launch. w may be
    a DeferredWgrad (its gradient then comes through the taps). With `layout`, x [N, in] holds the tokens and the
    result is that of gather_rows(x, layout.src, layout.dst): the 'pallas' kernel reads the rows in place."""
    if layout is not None:
        if impl == "pallas" and not isinstance(w, DeferredWgrad):
            from pallas_kernels import grouped_matmul as k
            return k.grouped_matmul(x, w, tile_group, tiling=tiling, src=layout.src, dst=layout.dst)
        x = gather_rows(x, layout.src, layout.dst)
    if isinstance(w, DeferredWgrad):
        if w.x.shape != x.shape or w.dy.shape != (x.shape[0], w.weight.shape[1]) or w.tiles.shape != tile_group.shape:
            raise ValueError(f"grouped_matmul: the deferred-gradient taps x {w.x.shape}, dy {w.dy.shape}, tiles "
                             f"{w.tiles.shape} do not match this layout (x {x.shape}, {tile_group.shape[0]} tiles)")
        return _deferred(x, w.weight, tile_group, w.x, w.dy, w.tiles, impl, tiling)
    if impl == "xla":
        return grouped_matmul_reference(x, w, tile_group)
    if impl == "pallas":
        from pallas_kernels import grouped_matmul as k
        return k.grouped_matmul(x, w, tile_group, tiling=tiling)
    raise ValueError(f"grouped_matmul: unknown impl {impl!r} (use 'xla' or 'pallas')")


def grouped_wgrad_sum(total, dys, xs, tile_groups, *, impl: str = "xla", tiling=None):
    """total [E, out, in] fp32 + the weight gradients of grouped_matmul(xs[i], w, tile_groups[i]) under dys[i], summed
    over i in fp32 ('pallas': one kernel adding them in place; 'xla': the per-tile jnp reference)."""
    if impl == "pallas":
        from pallas_kernels import grouped_matmul as k
        return k.grouped_wgrad_sum(total, dys, xs, tile_groups, tiling=tiling)
    if impl != "xla":
        raise ValueError(f"grouped_wgrad_sum: unknown impl {impl!r} (use 'xla' or 'pallas')")
    E = total.shape[0]
    for dy, x, tg in zip(dys, xs, tile_groups, strict=True):
        T = tg.shape[0]
        onehot = jax.nn.one_hot(tg.astype(jnp.int32), E, dtype=jnp.float32)  # idle tiles (E): all-zero rows
        per_tile = jnp.einsum("tmo,tmi->toi", dy.reshape(T, -1, dy.shape[1]), x.reshape(T, -1, x.shape[1]),
                              preferred_element_type=jnp.float32)
        total = total + jnp.einsum("te,toi->eoi", onehot, per_tile)
    return total


def block_rows(dtype, *, tiling=None) -> int:
    """The row tile to build the layout with for the 'pallas' kernels: `tiling`'s, else the platform default's.
    (The reference takes any tile.)"""
    if tiling is not None:
        return tiling.block_rows
    from pallas_kernels import grouped_matmul as k
    return k.default_tiling(dtype).block_rows


__all__ = ["DeferredWgrad", "TileLayout", "block_rows", "defer_wgrad", "gather_rows", "grouped_matmul",
           "grouped_matmul_reference", "grouped_wgrad_sum", "padded_rows", "tile_layout"]

"""The experts' forward without its passes over the activations (Pallas, Triton lowering), for programs that take
no gradient (scoring, prefill). On the tile-padded layout of zaya_jax.ops.grouped_matmul.tile_layout (src: the token
of each padded row, N for padding; tile_group: each row unit's expert):

  up    h[row]      = act(x[src[row]] @ w_gu[g, :I]ᵀ) * (x[src[row]] @ w_gu[g, I:]ᵀ)
        reads its A rows from token order through src, and one program holds a gate tile and its up tile, so
        SwiGLU happens in its epilogue;
  down  out[src[row]] = (h[row] @ w_down[g]ᵀ) * weight[src[row]]
        writes each row straight to its token's position, scaled by the routing weight.

The unfused path (model/experts.py, moe_impl 'pallas') spends four passes over the activations around its GEMMs:
the gather of x into the layout, the [rows, 2I] gate/up product written and read back by the SwiGLU, and the gather
back with the weight's multiply. Tokens that no row holds (the skip class) keep the zeros of the output buffer the
down kernel writes into. Roundings are the unfused path's: each GEMM's fp32 sum rounded to the compute dtype, then
the SwiGLU and the weight's product, each rounded once (jax.nn.silu as one op).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform, vma
from pallas_kernels._grouped_kernels import swizzled_tile
from pallas_kernels.grouped_matmul import GroupedTiling, default_tiling, program_tiles, units_per_tile

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ


def _tiles_of(n: int, block: int) -> int:
    """A block no wider than the (power-of-two rounded) dimension and never below 16 (Triton's smallest dot)."""
    return max(16, min(block, platform.next_pow2(n)))


def blocks(hidden: int, inter: int, tiling: GroupedTiling):
    """(up: columns of the gate and of the up tile, contraction step; down: columns, contraction step). A program of
    the up kernel computes a gate tile and its up tile in one dot of the forward's tile width."""
    return (_tiles_of(inter, max(16, tiling.fwd_n // 2)), _tiles_of(hidden, tiling.fwd_k),
            _tiles_of(hidden, tiling.fwd_n), _tiles_of(inter, tiling.fwd_k))


def supported(hidden: int, inter: int, dtype, tiling: GroupedTiling | None = None) -> bool:
    """Whether the widths are whole tiles (ZAYA1's are; the unfused kernels pad any other)."""
    up_n, up_k, down_n, down_k = blocks(hidden, inter, tiling or default_tiling(dtype))
    return inter % up_n == 0 and hidden % up_k == 0 and hidden % down_n == 0 and inter % down_k == 0


def _tile(unit_ref, group_ref, units_ref, bm, num_tiles, num_col_tiles, group_rows):
    tile, col = swizzled_tile(pl.program_id(0), num_tiles, num_col_tiles, group_rows)
    return group_ref[tile], units_ref[tile], pl.multiple_of(unit_ref[tile] * bm, bm), col


def _token_rows(src_ref, rows, num_tokens):
    """The tokens of these padded rows (padding rows: N, past the last) and which rows hold a token."""
    src = src_ref[rows]
    return src, src < num_tokens


def _up_kernel(unit_ref, group_ref, units_ref, src_ref, x_ref, w_ref, h_ref, *, bm, span, bn, bk, k_steps,
               num_tiles, num_col_tiles, group_rows, num_groups, num_tokens, inter, act, precision):
    g, n, first, col = _tile(unit_ref, group_ref, units_ref, bm, num_tiles, num_col_tiles, group_rows)
    # one 2bn-wide B tile: bn gate rows then the matching bn up rows (one dot as wide as the unfused kernel's)
    lanes = jnp.arange(2 * bn)
    w_rows = (col * bn + lanes + jnp.where(lanes >= bn, inter - bn, 0))[:, None]

    def compute(m):
        rows = pl.ds(first, m)
        src, held = _token_rows(src_ref, rows, num_tokens)
        src = jnp.where(held, src, 0)[:, None]

        def step(k, acc):
            ks = (pl.multiple_of(k * bk, bk) + jnp.arange(bk))[None, :]
            a = plgpu.load(x_ref.at[src, ks], mask=held[:, None], other=0)
            return acc + lax.dot_general(a, w_ref[g, w_rows, ks], _NT, precision=precision,
                                         preferred_element_type=F32)

        gate, up = jnp.split(lax.fori_loop(0, k_steps, step, jnp.zeros((m, 2 * bn), F32)), 2, axis=1)
        dtype = h_ref.dtype
        activated = act(gate.astype(dtype).astype(F32)).astype(dtype)
        h_ref[rows, pl.ds(pl.multiple_of(col * bn, bn), bn)] = (
            activated.astype(F32) * up.astype(dtype).astype(F32)).astype(dtype)

    # padding rows load zeros (act(0) * 0 = 0 for the down kernel to multiply); units past the last expert are
    # left unwritten, as the down kernel skips them
    for u in range(1, span + 1):
        pl.when((n == u) & (g < num_groups))(functools.partial(compute, u * bm))


def _down_kernel(unit_ref, group_ref, units_ref, src_ref, scale_ref, h_ref, w_ref, _zeros_ref, out_ref, *, bm, span,
                 bn, bk, k_steps, num_tiles, num_col_tiles, group_rows, num_groups, num_tokens, precision):
    g, n, first, col = _tile(unit_ref, group_ref, units_ref, bm, num_tiles, num_col_tiles, group_rows)
    cols = pl.ds(pl.multiple_of(col * bn, bn), bn)

    def compute(m):
        rows = pl.ds(first, m)

        def step(k, acc):
            ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
            return acc + lax.dot_general(h_ref[rows, ks], w_ref[g, cols, ks], _NT, precision=precision,
                                         preferred_element_type=F32)

        acc = lax.fori_loop(0, k_steps, step, jnp.zeros((m, bn), F32))
        src, held = _token_rows(src_ref, rows, num_tokens)
        dtype = out_ref.dtype
        scale = plgpu.load(scale_ref.at[jnp.where(held, src, 0)], mask=held, other=0).astype(F32)
        y = (acc.astype(dtype).astype(F32) * scale[:, None]).astype(dtype)
        # padding rows keep their out-of-range row: a GPU skips masked lanes, the interpreter's scatter drops
        # out-of-range rows (an in-range stand-in would race with the real row's write there)
        plgpu.store(out_ref.at[src[:, None], (col * bn + jnp.arange(bn))[None, :]], y, mask=held[:, None])

    for u in range(1, span + 1):
        pl.when((n == u) & (g < num_groups))(functools.partial(compute, u * bm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _forward(x, src, tile_group, weight, w_gu, w_down, act, tiling, interpret):
    return _kernels(x, src, tile_group, weight, w_gu, w_down, act, tiling, interpret)


def _forward_fwd(x, src, tile_group, weight, w_gu, w_down, act, tiling, interpret):
    return _forward(x, src, tile_group, weight, w_gu, w_down, act, tiling, interpret), None


def _forward_bwd(act, tiling, interpret, res, dy):
    raise ValueError("the fused experts' forward (moe_impl 'fused') has no gradient: it serves scoring and "
                     "prefill; train with moe_impl 'pallas'")


_forward.defvjp(_forward_fwd, _forward_bwd)


def up_swiglu(x, src, tiles, w_gu, act, t: GroupedTiling, bm: int, interpret: bool):
    """h [Np, I]: the gate and up GEMMs of the rows src gathers from x, SwiGLU applied."""
    hidden, inter = x.shape[1], w_gu.shape[1] // 2
    up_n, up_k, _, _ = blocks(hidden, inter, t)
    return pl.pallas_call(
        functools.partial(_up_kernel, bn=up_n, bk=up_k, k_steps=hidden // up_k, num_col_tiles=inter // up_n,
                          inter=inter, act=act, **_common(t, x, tiles, bm, w_gu.shape[0])),
        out_shape=vma.out_struct((src.shape[0], inter), x.dtype, x),
        grid=(tiles.shape[1] * (inter // up_n),),
        compiler_params=platform.compiler_params(t.fwd_warps, t.fwd_stages),
        interpret=interpret, name="expert_up_swiglu",
    )(tiles[0], tiles[1], tiles[2], src, x, w_gu)


def down_scatter(h, src, tiles, weight, w_down, num_tokens: int, t: GroupedTiling, bm: int, interpret: bool):
    """[N, D]: each row of h @ w_down[g]ᵀ times its token's weight, at its token's position (zeros elsewhere)."""
    hidden, inter = w_down.shape[1], w_down.shape[2]
    _, _, down_n, down_k = blocks(hidden, inter, t)
    zeros = jnp.zeros((num_tokens, hidden), h.dtype)
    return pl.pallas_call(
        functools.partial(_down_kernel, bn=down_n, bk=down_k, k_steps=inter // down_k,
                          num_col_tiles=hidden // down_n, **_common(t, zeros, tiles, bm, w_down.shape[0])),
        out_shape=vma.out_struct((num_tokens, hidden), h.dtype, h),
        grid=(tiles.shape[1] * (hidden // down_n),),
        input_output_aliases={7: 0},
        compiler_params=platform.compiler_params(t.fwd_warps, t.fwd_stages),
        interpret=interpret, name="expert_down_scatter",
    )(tiles[0], tiles[1], tiles[2], src, weight, h, w_down, vma.vary_to_union(zeros, h)[0])


def _common(t: GroupedTiling, x, tiles, bm: int, num_groups: int) -> dict:
    return dict(bm=bm, span=units_per_tile(t, bm), num_tiles=tiles.shape[1], group_rows=t.group_rows,
                num_groups=num_groups, num_tokens=x.shape[0], precision=platform.dot_precision(x.dtype))


def _kernels(x, src, tile_group, weight, w_gu, w_down, act, t: GroupedTiling, interpret: bool):
    bm = src.shape[0] // tile_group.shape[0]
    tiles = program_tiles(tile_group, w_gu.shape[0], units_per_tile(t, bm))
    x, src, weight, w_gu, w_down, tiles = vma.vary_to_union(x, src, weight, w_gu, w_down, tiles)
    h = up_swiglu(x, src, tiles, w_gu, act, t, bm, interpret)
    return down_scatter(h, src, tiles, weight, w_down, x.shape[0], t, bm, interpret)


@functools.partial(jax.jit, static_argnames=("act", "tiling", "interpret"))
def expert_forward(x, src, tile_group, weight, w_gu, w_down, *, act, tiling: GroupedTiling | None = None,
                   interpret: bool | None = None):
    """x [N, D], the layout's src [Np] and tile_group [T], routing weight [N] (0 for skipped tokens), w_gu [E, 2I, D],
    w_down [E, D, I], all in one compute dtype but src / tile_group -> the experts' weighted output [N, D] in token
    order (zero rows for the tokens no padded row holds). Widths must be whole tiles (`supported`)."""
    num_tokens, hidden = x.shape
    if w_gu.ndim != 3 or w_gu.shape[2] != hidden or w_gu.shape[1] % 2 or w_down.shape != (
            w_gu.shape[0], hidden, w_gu.shape[1] // 2):
        raise ValueError(f"expert_forward: x {x.shape}, w_gu {w_gu.shape}, w_down {w_down.shape} do not match "
                         "([N, D], [E, 2I, D], [E, D, I])")
    if src.shape[0] % tile_group.shape[0] or weight.shape != (num_tokens,):
        raise ValueError(f"expert_forward: src {src.shape}, tile_group {tile_group.shape}, weight {weight.shape} "
                         f"are not a layout of {num_tokens} tokens")
    t = tiling or default_tiling(x.dtype)
    if not supported(hidden, w_down.shape[2], x.dtype, t):
        raise ValueError(f"expert_forward: widths D={hidden}, I={w_down.shape[2]} are not whole tiles "
                         f"{blocks(hidden, w_down.shape[2], t)}")
    interpret = platform.interpret() if interpret is None else interpret
    return _forward(x, src.astype(jnp.int32), tile_group.astype(jnp.int32), weight.astype(x.dtype),
                    w_gu.astype(x.dtype), w_down.astype(x.dtype), act, t, interpret)


__all__ = ["blocks", "down_scatter", "expert_forward", "supported", "up_swiglu"]

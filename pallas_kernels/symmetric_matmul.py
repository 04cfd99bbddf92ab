"""Symmetric Gram product G = X Xᵀ that computes only the upper-triangle output tiles and mirrors them.

Newton-Schulz needs two symmetric products per step: A = X Xᵀ and A·A. For a symmetric A, A·A = A Aᵀ, so both
are Gram products and one kernel serves both (`symmetric_square`). Only tiles (r, c) with r <= c are computed;
each program writes its tile and, off the diagonal, the transposed tile, which saves about half of the
multiply-adds of that product. An optional epilogue adds a symmetric addend, so NS's B = b·A + c·A·A is one pass.

Lowering: Pallas with the Triton backend (the one Pallas GPU path that runs on ROCm and NVIDIA): fp32
accumulation, output in the input dtype (bf16 in, bf16 out), no atomics, no inline assembly. On the CPU the same
kernel runs in interpret mode. Inputs are zero-padded to whole tiles (zero rows of X give zero rows and columns
of X Xᵀ, so the top-left block is exact) and the result is cut back; ZAYA1's Muon shapes need no padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _platform


@dataclasses.dataclass(frozen=True)
class GramTiling:
    """Output tile (tile x tile), contraction step tile_k, and Triton launch parameters. upper_only=False computes
    every tile (no mirroring): the same kernel as a plain GEMM, kept to measure what the symmetry saves."""

    tile: int = 128
    tile_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    upper_only: bool = True


def default_tiling(dtype) -> GramTiling:
    vendor = _platform.vendor()
    if vendor == "cpu":  # interpret mode: small tiles keep the interpreter quick and exercise several tiles
        return GramTiling(tile=32, tile_k=16, num_warps=4, num_stages=1)
    if jnp.dtype(dtype).itemsize >= 4:  # fp32 tiles take twice the shared memory per stage
        tiling = GramTiling(tile=64, tile_k=32, num_warps=4, num_stages=3)
    else:
        tiling = GramTiling()
    if vendor == "rocm":  # 64-lane wavefronts: half the warps for as many lanes; AMD's pipeliner wants <= 2 stages
        tiling = dataclasses.replace(tiling, num_warps=max(1, tiling.num_warps // 2),
                                     num_stages=min(2, tiling.num_stages))
    return tiling


def num_upper_tiles(num_tile_rows: int) -> int:
    return num_tile_rows * (num_tile_rows + 1) // 2


def upper_tile_coords(p):
    """Program p -> tile (row, col), row <= col, enumerating the upper triangle column by column:
    (0,0), (0,1), (1,1), (0,2), ... so consecutive programs share the column block of X (L2 reuse).
    col = floor((sqrt(8p + 1) - 1) / 2), corrected by one either way for float rounding."""
    p = jnp.asarray(p, jnp.int32)
    col = ((jnp.sqrt((8 * p + 1).astype(jnp.float32)) - 1.0) * 0.5).astype(jnp.int32)
    col = jnp.where(lax.div((col + 1) * (col + 2), 2) <= p, col + 1, col)
    col = jnp.where(lax.div(col * (col + 1), 2) > p, col - 1, col)
    row = p - lax.div(col * (col + 1), 2)
    return row, col


def _gram_kernel(x_ref, *refs, tile: int, tile_k: int, k_steps: int, tile_rows: int, upper_only: bool,
                 precision, alpha: float, beta: float):
    add_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    p = pl.program_id(0)
    row, col = upper_tile_coords(p) if upper_only else (lax.div(p, tile_rows), lax.rem(p, tile_rows))
    rows = pl.ds(pl.multiple_of(row * tile, tile), tile)
    cols = pl.ds(pl.multiple_of(col * tile, tile), tile)

    def accumulate(k, acc):
        ks = pl.ds(pl.multiple_of(k * tile_k, tile_k), tile_k)
        a = x_ref[rows, ks]
        b = x_ref[cols, ks]
        return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_steps, accumulate, jnp.zeros((tile, tile), jnp.float32))
    if alpha != 1.0:
        acc = alpha * acc
    if add_ref is not None:  # fused epilogue, in fp32; the addend is symmetric, so its (col, row) tile is this one's ᵀ
        acc = acc + beta * add_ref[rows, cols].astype(jnp.float32)
    out = acc.astype(o_ref.dtype)
    o_ref[rows, cols] = out

    if upper_only:
        @pl.when(row != col)
        def _mirror():
            o_ref[cols, rows] = out.T


def _pad_to(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("alpha", "beta", "tiling", "interpret"))
def symmetric_gram(x, addend=None, *, alpha: float = 1.0, beta: float = 1.0, tiling: GramTiling | None = None,
                   interpret: bool | None = None):
    """alpha·X Xᵀ (+ beta·addend) for x [..., m, k] (leading dims are batch dims) -> [..., m, m] in x.dtype, fp32
    accumulation. `addend` [..., m, m] must be symmetric (Newton-Schulz: b·A + c·A·A in one pass over A)."""
    if x.ndim < 2:
        raise ValueError(f"symmetric_gram needs a matrix or a stack of matrices, got shape {x.shape}")
    if addend is not None and addend.shape != x.shape[:-1] + (x.shape[-2],):
        raise ValueError(f"addend must have shape {x.shape[:-1] + (x.shape[-2],)}, got {addend.shape}")
    tiling = tiling or default_tiling(x.dtype)
    interpret = _platform.interpret() if interpret is None else interpret
    *batch, m, k = x.shape
    # A tile larger than the matrix would only add padding; Triton's dot needs at least 16.
    tile = min(tiling.tile, max(16, pl.next_power_of_2(m)))
    tile_k = min(tiling.tile_k, max(16, pl.next_power_of_2(k)))
    xb = x.reshape((math.prod(batch), m, k))
    xb = _pad_to(_pad_to(xb, 1, tile), 2, tile_k)
    _, mp, kp = xb.shape
    tile_rows = mp // tile
    precision = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None
    kernel = functools.partial(_gram_kernel, tile=tile, tile_k=tile_k, k_steps=kp // tile_k, tile_rows=tile_rows,
                               upper_only=tiling.upper_only, precision=precision, alpha=float(alpha),
                               beta=float(beta))
    programs = num_upper_tiles(tile_rows) if tiling.upper_only else tile_rows * tile_rows
    square = pl.BlockSpec((None, mp, mp), lambda p, b: (b, 0, 0))
    operands, in_specs = [xb], [pl.BlockSpec((None, mp, kp), lambda p, b: (b, 0, 0))]
    if addend is not None:
        operands.append(_pad_to(_pad_to(addend.reshape((xb.shape[0], m, m)), 1, tile), 2, tile))
        in_specs.append(square)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((xb.shape[0], mp, mp), x.dtype),
        grid=(programs, xb.shape[0]),
        in_specs=in_specs,
        out_specs=square,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="symmetric_gram",
    )(*operands)
    return out[:, :m, :m].reshape((*batch, m, m))


def symmetric_square(a, **kw):
    """A·A for a symmetric a [..., m, m]: equal to A Aᵀ, so the Gram kernel computes it on half the tiles.
    The caller guarantees symmetry (Newton-Schulz's A = X Xᵀ is symmetric by construction)."""
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"symmetric_square needs square matrices, got shape {a.shape}")
    return symmetric_gram(a, **kw)


__all__ = ["GramTiling", "default_tiling", "num_upper_tiles", "upper_tile_coords", "symmetric_gram",
           "symmetric_square"]

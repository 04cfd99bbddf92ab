"""Per-row ranks for order statistics (zaya_jax/ops/order_statistics.py) as a Pallas kernel (Triton lowering).

rows_above(x) [R, N] -> int32 [R, N]: for each element the number of elements of its row strictly above it. Its
rank-k element is then a masked minimum (min over the elements with at most k - 1 above them), exact, with ties.

Why not a sort: the balancing solve takes two order statistics of each of 16 rows of 2048 margins in every round,
and XLA's sort of that block is one long kernel, most of a round's time on the H200 (docs/routing.md). Counting is
R x N x N comparisons, but they spread over every compute unit: one program per (row, block of tokens) holds its
block's values and walks the row in chunks, summing the comparisons element-wise into a [block, chunk] tile and
reducing it once at the end (a reduction per chunk would be a cross-lane exchange per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import platform
from pallas_kernels import vma

I32 = jnp.int32
# elements whose ranks one program counts, and row elements compared per loop step: the [BLOCK, CHUNK] int32 sums
# stay in registers (32 per thread at 4 warps; a [128, 256] tile spilled and ran 25x slower than XLA's sort)
BLOCK = 64
CHUNK = 64


def _kernel(row_ref, block_ref, out_ref, *, chunks: int):
    mine = block_ref[0, :][:, None]

    def step(i, acc):
        other = row_ref[0, pl.ds(i * CHUNK, CHUNK)][None, :]
        return acc + (other > mine).astype(I32)

    acc = jax.lax.fori_loop(0, chunks, step, jnp.zeros((BLOCK, CHUNK), I32))
    out_ref[0, :] = jnp.sum(acc, axis=1)


def rows_above(x):
    """x [R, N] float (no NaN) -> int32 [R, N], the number of elements of the same row strictly greater."""
    rows, n = x.shape
    padded = max(pl.next_power_of_2(n), CHUNK)
    x = jnp.pad(jax.lax.stop_gradient(x), ((0, 0), (0, padded - n)), constant_values=-jnp.inf)
    (x,) = vma.vary_to_union(x)
    above = pl.pallas_call(
        functools.partial(_kernel, chunks=padded // CHUNK),
        grid=(rows, padded // BLOCK),
        in_specs=[pl.BlockSpec((1, padded), lambda r, b: (r, 0)), pl.BlockSpec((1, BLOCK), lambda r, b: (r, b))],
        out_specs=pl.BlockSpec((1, BLOCK), lambda r, b: (r, b)),
        out_shape=vma.out_struct((rows, padded), I32, x),
        compiler_params=platform.compiler_params(4, 1),
        interpret=platform.interpret())(x, x)
    return above[:, :n]

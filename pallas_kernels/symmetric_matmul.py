"""Symmetric Gram product G = X Xᵀ that computes only the upper-triangle output tiles and mirrors them.

Newton-Schulz needs two symmetric products per step: A = X Xᵀ and A·A. For a symmetric A, A·A = A Aᵀ, so both
are Gram products and one kernel serves both (`symmetric_square`). Only tiles (r, c) with r <= c are computed;
each program writes its tile and, off the diagonal, the transposed tile, which saves about half of the
multiply-adds of that product. An optional epilogue adds a symmetric addend, so NS's B = b·A + c·A·A is one pass.

Lowering: Pallas with the Triton backend (the one Pallas GPU path that runs on ROCm and NVIDIA): fp32
accumulation, output in the input dtype (bf16 in, bf16 out), no atomics, no inline assembly. On the CPU the same
kernel runs in interpret mode. Under jit with sharded inputs the kernel is a custom partitioned op: every device
runs it on its own matrices when only batch dims are sharded (a sharded matrix dim is gathered first: each matrix
must be whole on one device). Inputs are zero-padded to whole tiles (zero rows of X give zero rows and columns
of X Xᵀ, so the top-left block is exact) and the result is cut back; ZAYA1's Muon shapes need no padding, and
then nothing is copied.

Tiles may be wide (tile x tile_cols, tile_cols a multiple of tile): the wider tile does more multiply-adds per byte
loaded, at the price of computing whole tile_cols x tile_cols diagonal blocks (see `upper_tile_coords`).

Launch order and the last wave: one 1-D grid over the whole stack, matrix-major (a matrix's tiles run together, so
its X stays in L2 while they do), column block by column block inside a matrix. All programs do the same work, so
with S programs resident at once a stack of N tiles takes ceil(N / S) waves; the last one may be nearly empty
(8 x 2048² in 128 x 256 tiles: 576 tiles on 132 SMs = 4 full waves + 48). With `tail_slots` = S set, the
tiles of a last wave that would fill at most half of S are each split into two half-height programs, so the last
wave holds twice the programs for half the time (4.5 waves instead of 5 in that example).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as plgpu
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels import platform


@dataclasses.dataclass(frozen=True)
class GramTiling:
    """Output tile (tile x tile_cols; tile_cols 0 = square), contraction step tile_k, and Triton launch parameters.
    upper_only=False computes every tile (no mirroring): the same kernel as a plain GEMM, kept to measure what the
    symmetry saves. tail_slots: programs resident at once on the device (SMs x programs per SM; 0 = off): the
    last wave's tiles are split in two half-height programs when that halves the last wave (module docstring)."""

    tile: int = 128
    tile_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    upper_only: bool = True
    tile_cols: int = 0
    tail_slots: int = 0

    def __post_init__(self):
        for name in ("tile", "tile_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GramTiling.{name} must be a power of two >= 16 (Triton dot), got {value}")
        if self.tile_cols and (self.tile_cols < self.tile or self.tile_cols & (self.tile_cols - 1)):
            raise ValueError(f"GramTiling.tile_cols must be 0 or a power of two >= tile ({self.tile}), "
                             f"got {self.tile_cols}")
        if self.tail_slots < 0:
            raise ValueError(f"GramTiling.tail_slots must be >= 0 (0 = no tail split), got {self.tail_slots}")

    @property
    def cols(self) -> int:
        return self.tile_cols or self.tile


def default_tiling(dtype) -> GramTiling:
    vendor = platform.vendor()
    if vendor == "cpu":  # interpret mode: small tiles keep the interpreter quick and exercise several tiles
        return GramTiling(tile=32, tile_k=16, num_warps=4, num_stages=1)
    if jnp.dtype(dtype).itemsize >= 4:  # fp32 tiles take twice the shared memory per stage
        tiling = GramTiling(tile=64, tile_k=32, num_warps=4, num_stages=3)
    else:  # fastest of the H200 sweep on 8 x 2048x2048 (docs/experiments.md): 128x128 tiles, k 64, and the
        # last partial wave split in halves with 2 programs resident per SM
        tiling = GramTiling(tile=128, tile_k=64, num_warps=4, num_stages=3,
                            tail_slots=2 * platform.compute_units() if vendor == "cuda" else 0)
    if vendor == "rocm":  # 64-lane wavefronts: half the warps for as many lanes; AMD's pipeliner wants <= 2 stages
        tiling = dataclasses.replace(tiling, num_warps=max(1, tiling.num_warps // 2),
                                     num_stages=min(2, tiling.num_stages))
    return tiling


def num_upper_tiles(num_tile_cols: int, wide: int = 1) -> int:
    """Programs of the upper triangle: column block c (tile_cols wide) holds wide·(c + 1) row tiles."""
    return wide * num_tile_cols * (num_tile_cols + 1) // 2


def tail_split(tiles: int, slots: int, tile: int) -> int:
    """How many of `tiles` equal tiles (the last ones) to split into two half-height programs, given `slots`
    programs resident at once: the whole last partial wave when its halves still fit in one wave, else none
    (splitting a fuller last wave would not shorten it). Halves keep >= 16 rows (Triton's dot)."""
    if slots <= 0 or tile < 32:
        return 0
    last = tiles % slots
    return last if 0 < 2 * last <= slots and tiles > last else 0


def _triangle_col(u):
    """u -> c with c(c+1)/2 <= u < (c+1)(c+2)/2: c = floor((sqrt(8u + 1) - 1) / 2), corrected by one either way
    for float rounding."""
    col = ((jnp.sqrt((8 * u + 1).astype(jnp.float32)) - 1.0) * 0.5).astype(jnp.int32)
    col = jnp.where(lax.div((col + 1) * (col + 2), 2) <= u, col + 1, col)
    return jnp.where(lax.div(col * (col + 1), 2) > u, col - 1, col)


def upper_tile_coords(p, wide: int = 1):
    """Program p -> (row tile, column block) of the upper triangle, column block by column block:
    column block c (tile_cols = wide·tile wide) holds row tiles 0 .. wide·(c+1) - 1, i.e. every row tile that
    starts above the block's bottom edge, so consecutive programs share the column block of X (L2 reuse).
    Row tiles r < wide·c lie strictly above the diagonal and are mirrored; the `wide` tiles r >= wide·c
    together cover the diagonal block whole (its lower part computed, not mirrored)."""
    p = jnp.asarray(p, jnp.int32)
    col = _triangle_col(lax.div(p, wide) if wide > 1 else p)
    row = p - wide * lax.div(col * (col + 1), 2)
    return row, col


def _gram_kernel(x_ref, *refs, tile: int, tile_cols: int, tile_k: int, k_steps: int, num_col_blocks: int,
                 upper_only: bool, precision, alpha: float, beta: float, diag: float, per_matrix: int,
                 whole_programs: int):
    """One program = one output tile of one matrix (x_ref / o_ref hold that matrix, picked by the index maps);
    programs from `whole_programs` on are the halves of the split tail tiles."""
    add_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    wide = tile_cols // tile
    p = pl.program_id(0)
    tile_id, half = _tile_of_program(p, whole_programs)
    u = lax.rem(tile_id, per_matrix)  # tile within its matrix
    if upper_only:
        row, col = upper_tile_coords(u, wide)
    else:
        row, col = lax.div(u, num_col_blocks), lax.rem(u, num_col_blocks)
    col0 = col * tile_cols
    cols = pl.ds(pl.multiple_of(col0, tile_cols), tile_cols)

    def product(row0, height: int):
        rows = pl.ds(pl.multiple_of(row0, height), height)

        def accumulate(k, acc):
            ks = pl.ds(pl.multiple_of(k * tile_k, tile_k), tile_k)
            a = x_ref[rows, ks]
            b = x_ref[cols, ks]
            return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, k_steps, accumulate, jnp.zeros((height, tile_cols), jnp.float32))
        # Epilogue in fp32 on the accumulator: alpha·X Xᵀ + beta·addend + diag·I.
        if alpha != 1.0:
            acc = alpha * acc
        if add_ref is not None:  # the addend is symmetric, so its (col, row) tile is this one's ᵀ
            acc = acc + beta * add_ref[rows, cols].astype(jnp.float32)
        if diag != 0.0:  # 1-D iotas broadcast (Triton's make_range is 1-D)
            on_diagonal = (row0 + jnp.arange(height))[:, None] == (col0 + jnp.arange(tile_cols))[None, :]
            acc = acc + jnp.where(on_diagonal, jnp.float32(diag), jnp.float32(0.0))
        out = acc.astype(o_ref.dtype)
        o_ref[rows, cols] = out  # written once; the mirror below comes from the same registers

        if upper_only:
            @pl.when(row < wide * col)  # strictly above the diagonal block
            def _mirror():
                o_ref[cols, rows] = out.T

    if whole_programs is None:  # no split tail: every program computes a whole tile
        product(row * tile, tile)
        return

    @pl.when(p < whole_programs)
    def _whole():
        product(row * tile, tile)

    @pl.when(p >= whole_programs)
    def _half():
        product(row * tile + half * (tile // 2), tile // 2)


def _tile_of_program(p, whole_programs):
    """Program p -> (tile index over the stack, which half): programs before `whole_programs` compute tile p whole,
    the ones after compute half 0 or 1 of tile whole_programs + (p - whole_programs) // 2."""
    if whole_programs is None:
        return p, 0
    extra = jnp.maximum(p - whole_programs, 0)
    return jnp.where(p < whole_programs, p, whole_programs + lax.div(extra, 2)), lax.rem(extra, 2)


@functools.partial(jax.jit, static_argnames=("alpha", "beta", "diag", "tiling", "interpret"))
def symmetric_gram(x, addend=None, *, alpha: float = 1.0, beta: float = 1.0, diag: float = 0.0,
                   tiling: GramTiling | None = None, interpret: bool | None = None):
    """alpha·X Xᵀ (+ beta·addend) (+ diag·I) for x [..., m, k] (leading dims are batch dims) -> [..., m, m] in
    x.dtype, fp32 accumulation. `addend` [..., m, m] must be symmetric. Newton-Schulz's B = a·I + b·A + c·A·A is
    one pass over A: symmetric_gram(A, A, alpha=c, beta=b, diag=a)."""
    if x.ndim < 2:
        raise ValueError(f"symmetric_gram needs a matrix or a stack of matrices, got shape {x.shape}")
    if addend is not None and addend.shape != x.shape[:-1] + (x.shape[-2],):
        raise ValueError(f"addend must have shape {x.shape[:-1] + (x.shape[-2],)}, got {addend.shape}")
    tiling = tiling or default_tiling(x.dtype)
    interpret = platform.interpret() if interpret is None else interpret
    config = (float(alpha), float(beta), float(diag), tiling, bool(interpret))
    if addend is None:
        return _gram_partitioned(x, config)
    return _gram_addend_partitioned(x, addend, config)


def _gram_local(x, addend, config):
    """The kernel on the matrices at hand (all of them, or one device's batch shard)."""
    alpha, beta, diag, tiling, interpret = config
    *batch, m, k = x.shape
    # A tile larger than the matrix would only add padding; Triton's dot needs at least 16.
    tile_cols = min(tiling.cols, max(16, pl.next_power_of_2(m)))
    tile = min(tiling.tile, tile_cols)
    tile_k = min(tiling.tile_k, max(16, pl.next_power_of_2(k)))
    xb = x.reshape((math.prod(batch), m, k))
    xb = platform.pad_to_multiple(platform.pad_to_multiple(xb, 1, tile_cols), 2, tile_k)
    _, mp, kp = xb.shape
    num_col_blocks = mp // tile_cols
    precision = platform.dot_precision(x.dtype)
    wide = tile_cols // tile
    per_matrix = (num_upper_tiles(num_col_blocks, wide) if tiling.upper_only
                  else (mp // tile) * num_col_blocks)
    tiles = per_matrix * xb.shape[0]
    split = tail_split(tiles, tiling.tail_slots, tile)
    whole_programs = tiles - split if split else None
    kernel = functools.partial(_gram_kernel, tile=tile, tile_cols=tile_cols, tile_k=tile_k, k_steps=kp // tile_k,
                               num_col_blocks=num_col_blocks, upper_only=tiling.upper_only, precision=precision,
                               alpha=float(alpha), beta=float(beta), diag=float(diag), per_matrix=per_matrix,
                               whole_programs=whole_programs)

    def matrix_of(p):  # the stack index a program works on: its matrix's X, addend and output
        return (lax.div(_tile_of_program(p, whole_programs)[0], per_matrix), 0, 0)

    square = pl.BlockSpec((None, mp, mp), matrix_of)
    operands, in_specs = [xb], [pl.BlockSpec((None, mp, kp), matrix_of)]
    if addend is not None:
        operands.append(platform.pad_to_multiple(platform.pad_to_multiple(addend.reshape((xb.shape[0], m, m)), 1, tile_cols), 2, tile_cols))
        in_specs.append(square)
    out = pl.pallas_call(
        kernel,
        # Inside shard_map (ZeRO-1's Newton-Schulz placement) the output varies over the mesh axes x varies over.
        out_shape=jax.ShapeDtypeStruct((xb.shape[0], mp, mp), x.dtype,
                                       manual_axis_type=getattr(jax.typeof(xb), "mat", None)),
        grid=(tiles + split,),  # matrix-major: a matrix's tiles run together (its X stays in L2)
        in_specs=in_specs,
        out_specs=square,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="symmetric_gram",
    )(*operands)
    if mp != m:  # only a padded problem pays for the cut
        out = out[:, :m, :m]
    return out.reshape((*batch, m, m))


def _batch_only(sharding, ndim: int):
    """The sharding of the batch dims, the two matrix dims whole on every device."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:ndim - 2], None, None))


def _partition(config, mesh, arg_shapes, result_shape):
    del result_shape
    x_sharding = _batch_only(arg_shapes[0].sharding, len(arg_shapes[0].shape))
    arg_shardings = tuple(x_sharding for _ in arg_shapes)  # the addend has x's batch dims too

    def lower(x, addend=None):
        return _gram_local(x, addend, config)
    return mesh, lower, x_sharding, arg_shardings


def _infer(config, mesh, arg_shapes, result_shape):  # GSPMD (non-Shardy) propagation
    del config, mesh, result_shape
    return _batch_only(arg_shapes[0].sharding, len(arg_shapes[0].shape))


@functools.partial(custom_partitioning, static_argnums=(1,))
def _gram_partitioned(x, config):
    return _gram_local(x, None, config)


@functools.partial(custom_partitioning, static_argnums=(2,))
def _gram_addend_partitioned(x, addend, config):
    return _gram_local(x, addend, config)


# Batch dims (...) pass through; the matrix dims must be whole on a device (need_replication, listed in the
# order the factors first appear, as Shardy requires).
_gram_partitioned.def_partition(_partition, infer_sharding_from_operands=_infer,
                                sharding_rule="... i k -> ... i j", need_replication_factors=("i", "k", "j"))
_gram_addend_partitioned.def_partition(_partition, infer_sharding_from_operands=_infer,
                                       sharding_rule="... i k, ... i j -> ... i j",
                                       need_replication_factors=("i", "k", "j"))


def symmetric_square(a, **kw):
    """A·A for a symmetric a [..., m, m]: equal to A Aᵀ, so the Gram kernel computes it on half the tiles.
    The caller guarantees symmetry (Newton-Schulz's A = X Xᵀ is symmetric by construction)."""
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"symmetric_square needs square matrices, got shape {a.shape}")
    return symmetric_gram(a, **kw)


__all__ = [
    "GramTiling",
    "default_tiling",
    "num_upper_tiles",
    "symmetric_gram",
    "symmetric_square",
    "tail_split",
    "upper_tile_coords",
]

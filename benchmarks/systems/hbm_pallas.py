"""Streaming kernels in Pallas (Triton lowering, so the same code runs on ROCm and NVIDIA; interpret mode on the
CPU) for the HBM sweep: a second opinion on XLA's bandwidth with nothing between the kernel and memory.

Buffers are viewed as [rows, COLS] and each program moves one [block_rows, COLS] tile: 64 x 256 fp32 = 64 KiB
per program is large enough to keep many loads in flight per lane and small enough for registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.platform import interpret, vendor

COLS = 256
BLOCK_ROWS = 64


def block_rows(rows: int) -> int:
    return min(BLOCK_ROWS, rows)


def _params():
    # 256 lanes per program: 8 CUDA warps of 32 or 4 ROCm wavefronts of 64
    return plgpu.CompilerParams(num_warps=4 if vendor() == "rocm" else 8, num_stages=1)


def _check(rows: int) -> int:
    br = block_rows(rows)
    if rows % br or br & (br - 1):
        raise ValueError(f"rows={rows} must be a power of two or a multiple of {BLOCK_ROWS}")
    return br


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _read_kernel(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...], axis=0, keepdims=True)


def _write_kernel(v_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(v_ref[...], o_ref.shape)


# `interpreted` is a static argument (None = decide by platform) so that a lowering forced for a GPU can never be
# served from the jit cache to a CPU call of the same shape.
@functools.partial(jax.jit, static_argnames="interpreted")
def copy(x, interpreted: bool | None = None):
    """[rows, COLS] -> a copy."""
    br = _check(x.shape[0])
    spec = pl.BlockSpec((br, COLS), lambda i: (i, 0))
    return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // br,),
                          in_specs=[spec], out_specs=spec, compiler_params=_params(),
                          interpret=_interpret(interpreted))(x)


@functools.partial(jax.jit, static_argnames="interpreted")
def read(x, interpreted: bool | None = None):
    """[rows, COLS] -> per-program column sums [rows / block_rows, COLS] (1/block_rows of the input written)."""
    br = _check(x.shape[0])
    grid = x.shape[0] // br
    return pl.pallas_call(_read_kernel, out_shape=jax.ShapeDtypeStruct((grid, COLS), x.dtype), grid=(grid,),
                          in_specs=[pl.BlockSpec((br, COLS), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((1, COLS), lambda i: (i, 0)), compiler_params=_params(),
                          interpret=_interpret(interpreted))(x)


@functools.partial(jax.jit, static_argnames=("rows", "interpreted"))
def write(value, rows: int, interpreted: bool | None = None):
    """value [1, COLS] -> [rows, COLS] filled with it."""
    br = _check(rows)
    return pl.pallas_call(_write_kernel, out_shape=jax.ShapeDtypeStruct((rows, COLS), value.dtype),
                          grid=(rows // br,), in_specs=[pl.BlockSpec((1, COLS), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((br, COLS), lambda i: (i, 0)), compiler_params=_params(),
                          interpret=_interpret(interpreted))(value)


def _interpret(interpreted: bool | None) -> bool:
    return interpret() if interpreted is None else interpreted

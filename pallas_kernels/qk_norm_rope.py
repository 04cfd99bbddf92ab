"""CCA's query/key normalisation and RoPE as one Pallas kernel (Triton lowering; interpret mode on the CPU), the
forward of `zaya_jax.ops.qk_norm_rope` (same contract as its reference, which also gives the backward):

    qk_norm_rope_forward(qk [B, T, H + KV, d], temp [KV], cos, sin [B, T, r], heads) -> q [B, T, H, d], k [B, T, KV, d]

A program owns `rows` positions of one head: it loads the head's three column blocks (the rotated halves x1, x2 and
the channels RoPE passes through) once, takes the L2 norm over all three in fp32, and writes the rotated head once.
Working on the blocks as separate tiles keeps the rotate-half pairing element-wise (x1 with x2 at the same index);
splitting one [rows, d] tile would move it through shared memory. Rounding follows the Hugging Face reference op by
op: the normalised head in the input dtype, then each product of the rotation and their sum.
Shapes whose column blocks are not powers of two (`supported`) are left to the reference.
"""

from __future__ import annotations

import contextlib
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform, vma

F32 = jnp.float32
# positions per program and warps: a bandwidth-bound pass with a few [rows, d] tiles per program
_TILES = {"cuda": (64, 4), "rocm": (64, 4), "cpu": (16, 4)}


@contextlib.contextmanager
def tiles_override(rows: int, warps: int):
    """Kernels traced inside use (rows, warps) on this backend (the kernel benchmark's sweep)."""
    vendor = platform.vendor()
    saved = _TILES[vendor]
    _TILES[vendor] = (rows, warps)
    try:
        yield
    finally:
        _TILES[vendor] = saved


def supported(d: int, r: int) -> bool:
    """Triton tiles are powers of two: the rotated halves and the pass-through block must be."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(r) and (d == 2 * r or pow2(d - 2 * r))


def _kernel(x_ref, cos_ref, sin_ref, temp_ref, q_ref, k_ref, *, rows, n_rows, heads, d, r, eps, scale):
    row0 = pl.program_id(0) * rows
    head = pl.program_id(1)
    ok = ((row0 + jnp.arange(rows)) < n_rows)[:, None]
    dt = q_ref.dtype
    rnd = lambda v: v.astype(dt).astype(F32)  # noqa: E731  (a rounding point of the reference)
    here = pl.ds(row0, rows)

    def load(ref, col, width):
        return plgpu.load(ref.at[here, pl.ds(col, width)], mask=ok, other=0).astype(F32)

    first = head * d
    x1, x2 = load(x_ref, first, r), load(x_ref, first + r, r)
    rest = load(x_ref, first + 2 * r, d - 2 * r) if d > 2 * r else None
    ss = jnp.sum(x1 * x1, axis=1, keepdims=True) + jnp.sum(x2 * x2, axis=1, keepdims=True)
    if rest is not None:
        ss = ss + jnp.sum(rest * rest, axis=1, keepdims=True)
    inv = scale / jnp.sqrt(jnp.maximum(ss, eps * eps))
    # key heads times their temperature (a query head's factor is 1: the product is exact)
    t = jnp.where(head >= heads, temp_ref[jnp.maximum(head - heads, 0)].astype(F32), 1.0)
    x1, x2 = rnd(x1 * inv * t), rnd(x2 * inv * t)
    c, s = load(cos_ref, 0, r), load(sin_ref, 0, r)
    y1 = rnd(rnd(x1 * c) + rnd(-x2 * s))
    y2 = rnd(rnd(x2 * c) + rnd(x1 * s))
    blocks = [(0, y1), (r, y2)] + ([(2 * r, rnd(rest * inv * t))] if rest is not None else [])

    def store(ref, out_head):
        for col, y in blocks:
            plgpu.store(ref.at[here, pl.ds(out_head * d + col, y.shape[1])], y.astype(dt), mask=ok)

    pl.when(head < heads)(lambda: store(q_ref, head))
    pl.when(head >= heads)(lambda: store(k_ref, head - heads))


def qk_norm_rope_forward(qk, temp, cos, sin, heads: int):
    B, T, G, d = qk.shape
    r = cos.shape[-1]
    n = B * T
    rows, warps = _TILES[platform.vendor()]
    rows = min(rows, max(16, platform.next_pow2(n)))
    qk, temp, cos, sin = vma.vary_to_union(qk, temp, cos, sin)
    dt = qk.dtype
    kernel = functools.partial(_kernel, rows=rows, n_rows=n, heads=heads, d=d, r=r, eps=float(jnp.finfo(dt).eps),
                               scale=d ** 0.5)
    q, k = pl.pallas_call(
        kernel,
        out_shape=(vma.out_struct((n, heads * d), dt, qk), vma.out_struct((n, (G - heads) * d), dt, qk)),
        grid=(pl.cdiv(n, rows), G),
        compiler_params=platform.compiler_params(warps, 1),
        interpret=platform.interpret(),
        name="qk_norm_rope",
    )(qk.reshape(n, G * d), cos.reshape(n, r).astype(dt), sin.reshape(n, r).astype(dt), temp)
    return q.reshape(B, T, heads, d), k.reshape(B, T, G - heads, d)

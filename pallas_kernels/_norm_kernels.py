"""Row-wise norm kernels over [rows, D] (Pallas, Triton lowering): forward and backward launches.

Every kernel runs a few programs per compute unit; each walks a contiguous range of rows, one [rows, block_d]
tile per loop step, where block_d = next power of two >= D and the edges are masked, so any [N, D] works.
  * A row is read from memory once: its statistics are taken from registers in that single pass, accumulated in
    fp32 (the LayerNorm variance is centred in registers, the exact form of what a streaming Welford update
    approximates).
  * The [D] parameter vectors are loaded once per program, not once per row: re-reading them per row moves more
    bytes through the caches than the rows move through HBM (measured on the H200: the merge re-reading its four
    vectors per row ran at 0.50-0.68 of copy bandwidth, against 0.73-0.83 holding them).
  * Tiles are loaded `launch.prefetch` steps ahead (carried through the loop; 3 in the H200 backward row, 1
    elsewhere), so their memory traffic overlaps the current tile's reductions. Triton does not pipeline these
    loads through shared memory (num_stages > 1 changes nothing without a dot in the loop), so what is in flight
    sits in registers.
  * The backward keeps per-column partial sums of the parameter gradients in registers as [rows, block_d] tiles
    (element-wise adds per step: summing over the tile's rows every step would be a cross-warp reduction through
    shared memory on each step) and folds the rows once at the end, writing one [n_partials, D] block per program
    into a single partials array; the wrapper sums it over programs (one small XLA reduction). No float atomics
    (not portable to ROCm), no second pass over the activations.
  * A launch with programs_per_cu = 0 gives every program a single tile (no loop, no prefetch): the hardware
    scheduler then hides the latency with many resident programs. Meant for the forward; in a backward each program
    writes its own [D] partials, so that costs (rows / tile rows) x D x 4 bytes per partial.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform
from pallas_kernels import vma

F32 = jnp.float32


def _masks(row0, rows: int, n_rows: int, block_d: int, d: int):
    row_ok = (row0 + jnp.arange(rows)) < n_rows
    col_ok = jnp.arange(block_d) < d
    return row_ok, row_ok[:, None] & col_ok[None, :]


def _load_tile(ref, start, rows, mask):
    return plgpu.load(ref.at[pl.ds(start, rows), :], mask=mask, other=0.0)


def _load_stat(ref, start, rows, row_ok):
    return plgpu.load(ref.at[pl.ds(start, rows)], mask=row_ok, other=0.0)[:, None]


def _load_vec(ref, d):
    return plgpu.load(ref, mask=jnp.arange(ref.shape[0]) < d, other=0.0).astype(F32)[None, :]


def _store_tile(ref, start, rows, value, mask):
    plgpu.store(ref.at[pl.ds(start, rows), :], value.astype(ref.dtype), mask=mask)


def _store_stat(ref, start, rows, value, row_ok):
    plgpu.store(ref.at[pl.ds(start, rows)], value, mask=row_ok)


def _row_loop(n_iters: int, rows: int, n_rows: int, d: int, block_d: int, load, body, accs, prefetch: int = 1):
    """body(start, row_ok, mask, tiles, accs) -> accs over this program's row tiles; load(start, row_ok, mask)
    -> tiles runs `prefetch` steps ahead (0: in the step that uses them). `start` is relative to the program's
    block of rows.

    Tiles loaded ahead are carried through the loop in registers: a load's registers are reserved from its issue,
    so `prefetch` sets the bytes in flight per program (prefetch x tile bytes) at prefetch x tile registers. At a
    low occupancy (the backward: one program per SM) that is what covers the memory latency."""
    first_row = pl.program_id(0) * (n_iters * rows)

    def load_at(it):
        # Past the block's last step, re-read its last tile (in bounds, unused) instead of running past the block.
        start = jnp.minimum(it, n_iters - 1) * rows
        row_ok, mask = _masks(first_row + start, rows, n_rows, block_d, d)
        return load(start, row_ok, mask)

    def run(it, tiles, accs):  # tiles None: load them here
        start = it * rows
        row_ok, mask = _masks(first_row + start, rows, n_rows, block_d, d)
        return body(start, row_ok, mask, load(start, row_ok, mask) if tiles is None else tiles, accs)

    if n_iters == 1:  # one tile per program: nothing to prefetch
        return run(0, None, accs)
    if not prefetch:
        return jax.lax.fori_loop(0, n_iters, lambda it, accs: run(it, None, accs), accs)

    def step(it, carry):
        ahead, accs = carry  # ahead[k] holds the tiles of step it + k
        loaded = load_at(it + prefetch)
        return (*ahead[1:], loaded), run(it, ahead[0], accs)

    ahead = tuple(load_at(k) for k in range(prefetch))
    return jax.lax.fori_loop(0, n_iters, step, (ahead, accs))[1]


def _sum_rows(x):
    return jnp.sum(x, axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------- forward kernels
def _rms_fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, d, eps, n_rows, rows, n_iters, prefetch):
    block_d = x_ref.shape[-1]
    w = _load_vec(w_ref, d)

    def load(start, row_ok, mask):
        return _load_tile(x_ref, start, rows, mask)

    def body(start, row_ok, mask, x, accs):
        x = x.astype(F32)
        rstd = jax.lax.rsqrt(_sum_rows(x * x) / d + eps)
        _store_tile(y_ref, start, rows, w * (x * rstd), mask)
        _store_stat(rstd_ref, start, rows, rstd[:, 0], row_ok)
        return accs

    _row_loop(n_iters, rows, n_rows, d, block_d, load, body, (), prefetch)


def _merge_vectors(hs_ref, hb_ref, rs_ref, rb_ref, w_ref, d):
    """(hs, rs, c, w) with the two biases folded into c = hb * hs + rb * rs: one [D] vector fewer held in registers
    through the row loop, and no separate XLA launch to form c (a launch is not negligible next to this short
    kernel)."""
    hs, hb, rs, rb, w = (_load_vec(ref, d) for ref in (hs_ref, hb_ref, rs_ref, rb_ref, w_ref))
    return hs, rs, hb * hs + rb * rs, w


def _merge_fwd_kernel(b_ref, r_ref, hs_ref, hb_ref, rs_ref, rb_ref, w_ref, h_ref, y_ref, rstd_ref, *, d, eps, n_rows,
                      rows, n_iters, prefetch):
    """h = branch * hs + residual * rs + c (see _merge_vectors). Padded columns load zeros for every vector, so h is
    0 there and the statistics are exact; padded rows are never stored."""
    block_d = b_ref.shape[-1]
    hs, rs, c, w = _merge_vectors(hs_ref, hb_ref, rs_ref, rb_ref, w_ref, d)

    def load(start, row_ok, mask):
        return _load_tile(b_ref, start, rows, mask), _load_tile(r_ref, start, rows, mask)

    def body(start, row_ok, mask, tiles, accs):
        branch, resid = (t.astype(F32) for t in tiles)
        h = branch * hs + resid * rs + c
        rstd = jax.lax.rsqrt(_sum_rows(h * h) / d + eps)
        _store_tile(h_ref, start, rows, h, mask)
        _store_tile(y_ref, start, rows, w * (h * rstd), mask)
        _store_stat(rstd_ref, start, rows, rstd[:, 0], row_ok)
        return accs

    _row_loop(n_iters, rows, n_rows, d, block_d, load, body, (), prefetch)


def _layer_fwd_kernel(x_ref, w_ref, bias_ref, y_ref, mean_ref, rstd_ref, *, d, eps, n_rows, rows, n_iters,
                      prefetch):
    block_d = x_ref.shape[-1]
    w, bias = _load_vec(w_ref, d), _load_vec(bias_ref, d)

    def load(start, row_ok, mask):
        return _load_tile(x_ref, start, rows, mask)

    def body(start, row_ok, mask, x, accs):
        x = x.astype(F32)
        mean = _sum_rows(x) / d
        xc = jnp.where(mask, x - mean, 0.0)
        rstd = jax.lax.rsqrt(_sum_rows(xc * xc) / d + eps)
        _store_tile(y_ref, start, rows, w * (xc * rstd) + bias, mask)
        _store_stat(mean_ref, start, rows, mean[:, 0], row_ok)
        _store_stat(rstd_ref, start, rows, rstd[:, 0], row_ok)
        return accs

    _row_loop(n_iters, rows, n_rows, d, block_d, load, body, (), prefetch)


# --------------------------------------------------------------------------------------------- backward kernels
def _store_partials(ref, accs, d):
    """Folds each [rows, block_d] accumulator over its rows (once per program) into row k of this program's
    [n_partials, block_d] block: one partials array, so the wrapper's cross-program sum is one XLA reduction."""
    col_ok = (jnp.arange(ref.shape[-1]) < d)[None, :]
    for k, acc in enumerate(accs):
        plgpu.store(ref.at[pl.ds(k, 1), :], jnp.sum(acc, axis=0, keepdims=True), mask=col_ok)


def _zeros(rows, block_d, n):
    return (jnp.zeros((rows, block_d), F32),) * n


def _rms_bwd_kernel(x_ref, dy_ref, rstd_ref, w_ref, dx_ref, part_ref, *, d, n_rows, rows, n_iters, prefetch):
    block_d = x_ref.shape[-1]
    w = _load_vec(w_ref, d)

    def load(start, row_ok, mask):
        return (_load_tile(x_ref, start, rows, mask), _load_tile(dy_ref, start, rows, mask),
                _load_stat(rstd_ref, start, rows, row_ok))

    def body(start, row_ok, mask, tiles, accs):
        x, dy, rstd = tiles
        n = x.astype(F32) * rstd
        dy = dy.astype(F32)
        dn = dy * w
        _store_tile(dx_ref, start, rows, rstd * (dn - n * (_sum_rows(dn * n) / d)), mask)
        return (accs[0] + dy * n,)

    accs = _row_loop(n_iters, rows, n_rows, d, block_d, load, body, _zeros(rows, block_d, 1), prefetch)
    _store_partials(part_ref, accs, d)


def _merge_bwd_kernel(b_ref, r_ref, dh_ref, dy_ref, rstd_ref, hs_ref, hb_ref, rs_ref, rb_ref, w_ref,
                      db_ref, dr_ref, part_ref, *, d, n_rows, rows, n_iters, prefetch):
    """Partial column sums of g * branch, g * residual, g and dy * n (the wrapper adds the bias terms: no select
    per element). Padded rows load rstd = 0 and zero tiles, so their g and n are 0."""
    block_d = b_ref.shape[-1]
    hs, rs, c, w = _merge_vectors(hs_ref, hb_ref, rs_ref, rb_ref, w_ref, d)

    def load(start, row_ok, mask):
        return (_load_tile(b_ref, start, rows, mask), _load_tile(r_ref, start, rows, mask),
                _load_tile(dh_ref, start, rows, mask), _load_tile(dy_ref, start, rows, mask),
                _load_stat(rstd_ref, start, rows, row_ok))

    def body(start, row_ok, mask, tiles, accs):
        branch, resid, dh, dy, rstd = tiles
        acc_b, acc_r, acc_g, acc_w = accs
        branch, resid = branch.astype(F32), resid.astype(F32)
        n = (branch * hs + resid * rs + c) * rstd
        dy = dy.astype(F32)
        dn = dy * w
        g = dh.astype(F32) + rstd * (dn - n * (_sum_rows(dn * n) / d))  # total gradient of the merged residual
        _store_tile(db_ref, start, rows, g * hs, mask)
        _store_tile(dr_ref, start, rows, g * rs, mask)
        return acc_b + g * branch, acc_r + g * resid, acc_g + g, acc_w + dy * n

    accs = _row_loop(n_iters, rows, n_rows, d, block_d, load, body, _zeros(rows, block_d, 4), prefetch)
    _store_partials(part_ref, accs, d)


def _layer_bwd_kernel(x_ref, dy_ref, mean_ref, rstd_ref, w_ref, dx_ref, part_ref, *, d, n_rows, rows,
                      n_iters, prefetch):
    block_d = x_ref.shape[-1]
    w = _load_vec(w_ref, d)

    def load(start, row_ok, mask):
        return (_load_tile(x_ref, start, rows, mask), _load_tile(dy_ref, start, rows, mask),
                _load_stat(mean_ref, start, rows, row_ok), _load_stat(rstd_ref, start, rows, row_ok))

    def body(start, row_ok, mask, tiles, accs):
        x, dy, mean, rstd = tiles
        xhat = jnp.where(mask, (x.astype(F32) - mean) * rstd, 0.0)
        dy = dy.astype(F32)
        dn = dy * w
        dx = rstd * (dn - _sum_rows(dn) / d - xhat * (_sum_rows(dn * xhat) / d))
        _store_tile(dx_ref, start, rows, dx, mask)
        return accs[0] + dy * xhat, accs[1] + dy

    accs = _row_loop(n_iters, rows, n_rows, d, block_d, load, body, _zeros(rows, block_d, 2), prefetch)
    _store_partials(part_ref, accs, d)


# ------------------------------------------------------------------------------------------------------ launches
def _rows_call(kernel, name, *, rows_in, stats_in, vecs_in, rows_out, n_stats_out, n_partials, d, launch,
               programs=None, **kernel_kw):
    """Launches `kernel` over row ranges; returns (row outputs..., stat outputs..., summed partials...).
    Inside shard_map (check_vma) all inputs are made varying over the union of their mesh axes (a replicated
    weight next to sharded rows) and the outputs carry that type; the custom VJPs sum gradients back."""
    n_r, n_s = len(rows_in), len(stats_in)
    inputs = vma.vary_to_union(*rows_in, *stats_in, *vecs_in)
    rows_in, stats_in, vecs_in = inputs[:n_r], inputs[n_r:n_r + n_s], inputs[n_r + n_s:]
    n_rows = rows_in[0].shape[0]
    block_d = platform.next_pow2(d)
    rows = launch.rows
    programs = min(programs or platform.norm_programs(launch, n_rows), pl.cdiv(n_rows, rows))
    n_iters = pl.cdiv(n_rows, programs * rows)
    per_program = n_iters * rows
    programs = pl.cdiv(n_rows, per_program)
    row_spec = pl.BlockSpec((per_program, block_d), lambda i: (i, 0))
    stat_spec = pl.BlockSpec((per_program,), lambda i: (i,))
    vec_spec = pl.BlockSpec((block_d,), lambda i: (0,))
    if n_partials & (n_partials - 1):
        raise ValueError(f"n_partials must be 0 or a power of two (a Triton block dimension), got {n_partials}")
    part_spec = pl.BlockSpec((None, n_partials, block_d), lambda i: (i, 0, 0))
    like = rows_in[0]
    out_shape = ([vma.out_struct((n_rows, d), dt, like) for dt in rows_out]
                 + [vma.out_struct((n_rows,), F32, like)] * n_stats_out
                 + [vma.out_struct((programs, n_partials, d), F32, like)] * bool(n_partials))
    outs = pl.pallas_call(
        functools.partial(kernel, d=d, n_rows=n_rows, rows=rows, n_iters=n_iters, prefetch=launch.prefetch,
                          **kernel_kw),
        grid=(programs,),
        in_specs=[row_spec] * len(rows_in) + [stat_spec] * len(stats_in) + [vec_spec] * len(vecs_in),
        out_specs=[row_spec] * len(rows_out) + [stat_spec] * n_stats_out + [part_spec] * bool(n_partials),
        out_shape=out_shape,
        compiler_params=platform.compiler_params(launch.num_warps, launch.num_stages),
        interpret=platform.interpret(), name=name,
    )(*rows_in, *stats_in, *vecs_in)
    n_direct = len(rows_out) + n_stats_out
    sums = outs[n_direct].sum(axis=0) if n_partials else ()
    return (*outs[:n_direct], *sums)


def _launch(launch, d, phase):
    return launch or platform.norm_launch(platform.next_pow2(d), phase)


def rms_forward(x, w, *, eps, out_dtype, launch=None, programs=None):
    """x [N, D] -> (y [N, D] out_dtype, rstd [N] fp32)."""
    d = x.shape[1]
    return _rows_call(_rms_fwd_kernel, "rms_norm_fwd", rows_in=[x], stats_in=[], vecs_in=[w], rows_out=[out_dtype],
                      n_stats_out=1, n_partials=0, d=d, launch=_launch(launch, d, "fwd"), programs=programs,
                      eps=eps)


def merge_forward(branch, residual, hs, hb, rs, rb, w, *, eps, out_dtype, launch=None, programs=None):
    """-> (h [N, D] fp32, y [N, D] out_dtype, rstd [N] fp32)."""
    d = branch.shape[1]
    return _rows_call(_merge_fwd_kernel, "merge_rms_norm_fwd", rows_in=[branch, residual], stats_in=[],
                      vecs_in=[hs, hb, rs, rb, w], rows_out=[F32, out_dtype], n_stats_out=1,
                      n_partials=0, d=d, launch=_launch(launch, d, "fwd"), programs=programs, eps=eps)


def layer_forward(x, w, b, *, eps, out_dtype, launch=None, programs=None):
    """-> (y [N, D] out_dtype, mean [N] fp32, rstd [N] fp32)."""
    d = x.shape[1]
    return _rows_call(_layer_fwd_kernel, "layer_norm_fwd", rows_in=[x], stats_in=[], vecs_in=[w, b],
                      rows_out=[out_dtype], n_stats_out=2, n_partials=0, d=d, launch=_launch(launch, d, "fwd"),
                      programs=programs, eps=eps)


def rms_backward(x, dy, rstd, w, *, launch=None, programs=None):
    """-> (dx [N, D] x.dtype, dw [D] fp32)."""
    d = x.shape[1]
    return _rows_call(_rms_bwd_kernel, "rms_norm_bwd", rows_in=[x, dy], stats_in=[rstd], vecs_in=[w],
                      rows_out=[x.dtype], n_stats_out=0, n_partials=1, d=d, launch=_launch(launch, d, "bwd"),
                      programs=programs)


def merge_backward(branch, residual, dh, dy, rstd, hs, hb, rs, rb, w, *, launch=None, programs=None):
    """-> (d_branch, d_residual, sum(g * (branch + hb)), sum(g * (residual + rb)), sum(g), sum(dy * n))."""
    d = branch.shape[1]
    d_branch, d_resid, g_branch, g_resid, g_sum, g_w = _rows_call(
        _merge_bwd_kernel, "merge_rms_norm_bwd", rows_in=[branch, residual, dh, dy], stats_in=[rstd],
        vecs_in=[hs, hb, rs, rb, w], rows_out=[branch.dtype, residual.dtype], n_stats_out=0,
        n_partials=4, d=d, launch=_launch(launch, d, "bwd"), programs=programs)
    # sum(g * (branch + hb)) = sum(g * branch) + hb * sum(g), likewise for the residual
    return (d_branch, d_resid, g_branch + hb.astype(F32) * g_sum, g_resid + rb.astype(F32) * g_sum, g_sum, g_w)


def layer_backward(x, dy, mean, rstd, w, *, launch=None, programs=None):
    """-> (dx [N, D] x.dtype, dw [D] fp32, dbias [D] fp32)."""
    d = x.shape[1]
    return _rows_call(_layer_bwd_kernel, "layer_norm_bwd", rows_in=[x, dy], stats_in=[mean, rstd], vecs_in=[w],
                      rows_out=[x.dtype], n_stats_out=0, n_partials=2, d=d, launch=_launch(launch, d, "bwd"),
                      programs=programs)

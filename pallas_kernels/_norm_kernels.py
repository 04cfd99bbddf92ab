"""Row-wise norm kernels over [rows, D] (Pallas, Triton lowering): forward and backward launches.

Each forward program normalises `rows` whole rows held in registers, so a row is read from memory once and its
statistics come from that single pass, accumulated in fp32 (the LayerNorm variance is centred in registers, which
is the exact form of what a streaming Welford update approximates). A padded row of `block_d` = next power of two
>= D columns is masked at the edges, and so are rows past the end, so any [N, D] works.

Each backward program walks a contiguous range of rows, writes dx for them, and keeps per-column partial sums of
the parameter gradients in registers; the wrapper adds the [programs, D] partials (a tiny XLA reduction), which
avoids float atomics (not portable to ROCm) and a second pass over the activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _platform

F32 = jnp.float32


def _masks(row0, rows: int, n_rows: int, block_d: int, d: int):
    row_ok = (row0 + jnp.arange(rows)) < n_rows
    col_ok = jnp.arange(block_d) < d
    return row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def _load_rows(ref, start, rows, mask):
    return plgpu.load(ref.at[pl.ds(start, rows), :], mask=mask, other=0.0).astype(F32)


def _load_vec(ref, col_ok):
    return plgpu.load(ref, mask=col_ok, other=0.0).astype(F32)[None, :]


# ---------------------------------------------------------------------------------------------- forward kernels
def _rms_fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, d, eps, n_rows):
    rows, block_d = x_ref.shape
    row_ok, col_ok, mask = _masks(pl.program_id(0) * rows, rows, n_rows, block_d, d)
    x = _load_rows(x_ref, 0, rows, mask)
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    y = _load_vec(w_ref, col_ok) * (x * rstd[:, None])
    plgpu.store(y_ref, y.astype(y_ref.dtype), mask=mask)
    plgpu.store(rstd_ref, rstd, mask=row_ok)


def _merge_fwd_kernel(b_ref, r_ref, hs_ref, hb_ref, rs_ref, rb_ref, w_ref, h_ref, y_ref, rstd_ref, *, d, eps,
                      n_rows):
    rows, block_d = b_ref.shape
    row_ok, col_ok, mask = _masks(pl.program_id(0) * rows, rows, n_rows, block_d, d)
    branch = _load_rows(b_ref, 0, rows, mask) + _load_vec(hb_ref, col_ok)
    resid = _load_rows(r_ref, 0, rows, mask) + _load_vec(rb_ref, col_ok)
    h = branch * _load_vec(hs_ref, col_ok) + resid * _load_vec(rs_ref, col_ok)
    h = jnp.where(mask, h, 0.0)  # padded rows/columns would otherwise carry the biases into the statistics
    rstd = jax.lax.rsqrt(jnp.sum(h * h, axis=1) / d + eps)
    y = _load_vec(w_ref, col_ok) * (h * rstd[:, None])
    plgpu.store(h_ref, h.astype(h_ref.dtype), mask=mask)
    plgpu.store(y_ref, y.astype(y_ref.dtype), mask=mask)
    plgpu.store(rstd_ref, rstd, mask=row_ok)


def _layer_fwd_kernel(x_ref, w_ref, bias_ref, y_ref, mean_ref, rstd_ref, *, d, eps, n_rows):
    rows, block_d = x_ref.shape
    row_ok, col_ok, mask = _masks(pl.program_id(0) * rows, rows, n_rows, block_d, d)
    x = _load_rows(x_ref, 0, rows, mask)
    mean = jnp.sum(x, axis=1) / d
    xc = jnp.where(mask, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1) / d + eps)
    y = _load_vec(w_ref, col_ok) * (xc * rstd[:, None]) + _load_vec(bias_ref, col_ok)
    plgpu.store(y_ref, y.astype(y_ref.dtype), mask=mask)
    plgpu.store(mean_ref, mean, mask=row_ok)
    plgpu.store(rstd_ref, rstd, mask=row_ok)


def _forward_call(kernel, name, row_inputs, vec_inputs, row_outputs, n_stats, *, d, eps, launch):
    n_rows = row_inputs[0].shape[0]
    block_d = _platform._next_pow2(d)
    rows = launch.rows
    row_spec = pl.BlockSpec((rows, block_d), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((block_d,), lambda i: (0,))
    stat_spec = pl.BlockSpec((rows,), lambda i: (i,))
    out_shape = [jax.ShapeDtypeStruct((n_rows, d), dt) for dt in row_outputs]
    out_shape += [jax.ShapeDtypeStruct((n_rows,), F32)] * n_stats
    return pl.pallas_call(
        functools.partial(kernel, d=d, eps=eps, n_rows=n_rows),
        grid=(pl.cdiv(n_rows, rows),),
        in_specs=[row_spec] * len(row_inputs) + [vec_spec] * len(vec_inputs),
        out_specs=[row_spec] * len(row_outputs) + [stat_spec] * n_stats,
        out_shape=out_shape,
        compiler_params=_platform.compiler_params(launch.num_warps, launch.num_stages),
        interpret=_platform.interpret(), name=name,
    )(*row_inputs, *vec_inputs)


def rms_forward(x, w, *, eps, out_dtype, launch=None):
    """x [N, D] -> (y [N, D] out_dtype, rstd [N] fp32)."""
    launch = launch or _platform.norm_launch(_platform._next_pow2(x.shape[1]))
    return _forward_call(_rms_fwd_kernel, "rms_norm_fwd", [x], [w], [out_dtype], 1, d=x.shape[1], eps=eps,
                         launch=launch)


def merge_forward(branch, residual, hs, hb, rs, rb, w, *, eps, out_dtype, launch=None):
    """-> (h [N, D] fp32, y [N, D] out_dtype, rstd [N] fp32)."""
    launch = launch or _platform.norm_launch(_platform._next_pow2(branch.shape[1]))
    return _forward_call(_merge_fwd_kernel, "merge_rms_norm_fwd", [branch, residual], [hs, hb, rs, rb, w],
                         [F32, out_dtype], 1, d=branch.shape[1], eps=eps, launch=launch)


def layer_forward(x, w, b, *, eps, out_dtype, launch=None):
    """-> (y [N, D] out_dtype, mean [N] fp32, rstd [N] fp32)."""
    launch = launch or _platform.norm_launch(_platform._next_pow2(x.shape[1]))
    return _forward_call(_layer_fwd_kernel, "layer_norm_fwd", [x], [w, b], [out_dtype], 2, d=x.shape[1],
                         eps=eps, launch=launch)


# --------------------------------------------------------------------------------------------- backward kernels
def _row_loop(n_iters, rows, n_rows, block_d, d, body, accs):
    """Runs body(start, row_ok, col_ok, mask, accs) over this program's rows; accs are [block_d] fp32 sums."""
    first_row = pl.program_id(0) * n_iters * rows

    def step(it, accs):
        start = it * rows
        row_ok, col_ok, mask = _masks(first_row + start, rows, n_rows, block_d, d)
        return body(start, row_ok, col_ok, mask, accs)

    return jax.lax.fori_loop(0, n_iters, step, accs)


def _store_partials(refs, accs, d):
    col_ok = jnp.arange(refs[0].shape[-1]) < d
    for ref, acc in zip(refs, accs):
        plgpu.store(ref, acc, mask=col_ok)


def _rms_bwd_kernel(x_ref, dy_ref, rstd_ref, w_ref, dx_ref, dw_ref, *, d, n_rows, rows, n_iters):
    block_d = x_ref.shape[-1]
    w = _load_vec(w_ref, jnp.arange(block_d) < d)  # loop invariant: load once

    def body(start, row_ok, col_ok, mask, accs):
        (dw,) = accs
        x, dy = _load_rows(x_ref, start, rows, mask), _load_rows(dy_ref, start, rows, mask)
        rstd = plgpu.load(rstd_ref.at[pl.ds(start, rows)], mask=row_ok, other=0.0)[:, None]
        n = x * rstd
        dn = dy * w
        c = jnp.sum(dn * n, axis=1, keepdims=True) / d
        dx = rstd * (dn - n * c)
        plgpu.store(dx_ref.at[pl.ds(start, rows), :], dx.astype(dx_ref.dtype), mask=mask)
        return (dw + jnp.sum(dy * n, axis=0),)

    accs = _row_loop(n_iters, rows, n_rows, block_d, d, body, (jnp.zeros((block_d,), F32),))
    _store_partials([dw_ref], accs, d)


def _merge_bwd_kernel(b_ref, r_ref, dh_ref, dy_ref, rstd_ref, hs_ref, hb_ref, rs_ref, rb_ref, w_ref,
                      db_ref, dr_ref, p_hs_ref, p_rs_ref, p_g_ref, p_w_ref, *, d, n_rows, rows, n_iters):
    block_d = b_ref.shape[-1]

    def body(start, row_ok, col_ok, mask, accs):
        acc_hs, acc_rs, acc_g, acc_w = accs
        # Re-read the five [D] vectors per row tile (L1 hits) rather than pinning them in registers.
        hs, hb, rs, rb, w = (_load_vec(ref, col_ok) for ref in (hs_ref, hb_ref, rs_ref, rb_ref, w_ref))
        branch = jnp.where(mask, _load_rows(b_ref, start, rows, mask) + hb, 0.0)
        resid = jnp.where(mask, _load_rows(r_ref, start, rows, mask) + rb, 0.0)
        rstd = plgpu.load(rstd_ref.at[pl.ds(start, rows)], mask=row_ok, other=0.0)[:, None]
        n = (branch * hs + resid * rs) * rstd
        dy = _load_rows(dy_ref, start, rows, mask)
        dn = dy * w
        c = jnp.sum(dn * n, axis=1, keepdims=True) / d
        g = _load_rows(dh_ref, start, rows, mask) + rstd * (dn - n * c)  # total gradient of the merged residual
        plgpu.store(db_ref.at[pl.ds(start, rows), :], (g * hs).astype(db_ref.dtype), mask=mask)
        plgpu.store(dr_ref.at[pl.ds(start, rows), :], (g * rs).astype(dr_ref.dtype), mask=mask)
        return (acc_hs + jnp.sum(g * branch, axis=0), acc_rs + jnp.sum(g * resid, axis=0),
                acc_g + jnp.sum(g, axis=0), acc_w + jnp.sum(dy * n, axis=0))

    zeros = jnp.zeros((block_d,), F32)
    accs = _row_loop(n_iters, rows, n_rows, block_d, d, body, (zeros,) * 4)
    _store_partials([p_hs_ref, p_rs_ref, p_g_ref, p_w_ref], accs, d)


def _layer_bwd_kernel(x_ref, dy_ref, mean_ref, rstd_ref, w_ref, dx_ref, dw_ref, dbias_ref, *, d, n_rows, rows,
                      n_iters):
    block_d = x_ref.shape[-1]
    w = _load_vec(w_ref, jnp.arange(block_d) < d)

    def body(start, row_ok, col_ok, mask, accs):
        dw, dbias = accs
        x, dy = _load_rows(x_ref, start, rows, mask), _load_rows(dy_ref, start, rows, mask)
        mean = plgpu.load(mean_ref.at[pl.ds(start, rows)], mask=row_ok, other=0.0)[:, None]
        rstd = plgpu.load(rstd_ref.at[pl.ds(start, rows)], mask=row_ok, other=0.0)[:, None]
        xhat = jnp.where(mask, (x - mean) * rstd, 0.0)
        dn = dy * w
        c_mean = jnp.sum(dn, axis=1, keepdims=True) / d
        c_var = jnp.sum(dn * xhat, axis=1, keepdims=True) / d
        dx = rstd * (dn - c_mean - xhat * c_var)
        plgpu.store(dx_ref.at[pl.ds(start, rows), :], dx.astype(dx_ref.dtype), mask=mask)
        return dw + jnp.sum(dy * xhat, axis=0), dbias + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((block_d,), F32)
    accs = _row_loop(n_iters, rows, n_rows, block_d, d, body, (zeros, zeros))
    _store_partials([dw_ref, dbias_ref], accs, d)


def _backward_call(kernel, name, row_inputs, stat_inputs, vec_inputs, row_out_dtypes, n_partials, *, d, launch,
                   programs=None):
    n_rows = row_inputs[0].shape[0]
    block_d = _platform._next_pow2(d)
    rows = launch.rows
    programs = min(programs or _platform.norm_programs(), pl.cdiv(n_rows, rows))
    n_iters = pl.cdiv(n_rows, programs * rows)
    per_program = n_iters * rows
    programs = pl.cdiv(n_rows, per_program)
    row_spec = pl.BlockSpec((per_program, block_d), lambda i: (i, 0))
    stat_spec = pl.BlockSpec((per_program,), lambda i: (i,))
    vec_spec = pl.BlockSpec((block_d,), lambda i: (0,))
    part_spec = pl.BlockSpec((None, block_d), lambda i: (i, 0))
    out_shape = [jax.ShapeDtypeStruct((n_rows, d), dt) for dt in row_out_dtypes]
    out_shape += [jax.ShapeDtypeStruct((programs, d), F32)] * n_partials
    outs = pl.pallas_call(
        functools.partial(kernel, d=d, n_rows=n_rows, rows=rows, n_iters=n_iters),
        grid=(programs,),
        in_specs=[row_spec] * len(row_inputs) + [stat_spec] * len(stat_inputs) + [vec_spec] * len(vec_inputs),
        out_specs=[row_spec] * len(row_out_dtypes) + [part_spec] * n_partials,
        out_shape=out_shape,
        compiler_params=_platform.compiler_params(launch.num_warps, launch.num_stages),
        interpret=_platform.interpret(), name=name,
    )(*row_inputs, *stat_inputs, *vec_inputs)
    n_out = len(row_out_dtypes)
    return (*outs[:n_out], *(p.sum(axis=0) for p in outs[n_out:]))


def rms_backward(x, dy, rstd, w, *, launch=None, programs=None):
    """-> (dx [N, D] x.dtype, dw [D] fp32)."""
    launch = launch or _platform.norm_launch(_platform._next_pow2(x.shape[1]), "bwd")
    return _backward_call(_rms_bwd_kernel, "rms_norm_bwd", [x, dy], [rstd], [w], [x.dtype], 1, d=x.shape[1],
                          launch=launch, programs=programs)


def merge_backward(branch, residual, dh, dy, rstd, hs, hb, rs, rb, w, *, launch=None, programs=None):
    """-> (d_branch, d_residual, sum(g * (branch + hb)), sum(g * (residual + rb)), sum(g), sum(dy * n))."""
    launch = launch or _platform.norm_launch(_platform._next_pow2(branch.shape[1]), "bwd")
    return _backward_call(_merge_bwd_kernel, "merge_rms_norm_bwd", [branch, residual, dh, dy], [rstd],
                          [hs, hb, rs, rb, w], [branch.dtype, residual.dtype], 4, d=branch.shape[1],
                          launch=launch, programs=programs)


def layer_backward(x, dy, mean, rstd, w, *, launch=None, programs=None):
    """-> (dx [N, D] x.dtype, dw [D] fp32, dbias [D] fp32)."""
    launch = launch or _platform.norm_launch(_platform._next_pow2(x.shape[1]), "bwd")
    return _backward_call(_layer_bwd_kernel, "layer_norm_bwd", [x, dy], [mean, rstd], [w], [x.dtype], 2,
                          d=x.shape[1], launch=launch, programs=programs)

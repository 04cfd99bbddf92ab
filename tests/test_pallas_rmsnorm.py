"""Pallas norm kernels against the jnp references: interpret mode on the CPU, compiled kernels with `-m gpu`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import _norm_kernels as kern
from pallas_kernels import platform, vma
from pallas_kernels import rmsnorm as pk
from pallas_kernels.platform import NormLaunch
from zaya_jax.ops import rmsnorm as ops

EPS = 1e-5
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "kernel produced non-finite values"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _inputs(seed, n, d, dtype):
    k = jax.random.split(jax.random.key(seed), 10)
    x = (3.0 * jax.random.normal(k[0], (n, d)) + 0.5).astype(dtype)
    vecs = [1.0 + 0.2 * jax.random.normal(k[1 + i], (d,)) for i in range(6)]
    return k, x, vecs


def _assert_close(got, want, dtype, what):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape, a.dtype, b.dtype)
        err = rel_err(a, b)
        assert err <= TOL[dtype], f"{what}[{i}]: relative error {err:.2e} > {TOL[dtype]:.0e}"


# (rows, D): D not a power of two and rows not a multiple of the row tile; a 3-D [B, T, D] input.
SHAPES = [(13, 200), (2, 5, 64)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_forward_backward(shape, dtype):
    k, _, (w, *_) = _inputs(0, 1, shape[-1], dtype)
    x = (2.0 * jax.random.normal(k[7], shape) + 0.3).astype(dtype)
    ct = jax.random.normal(k[8], shape).astype(dtype)

    def vjp(fn):
        y, pull = jax.vjp(lambda x, w: fn(x, w, EPS, dtype), x, w)
        return y, pull(ct)

    _assert_close(vjp(pk.rms_norm), vjp(ops.rms_norm_reference), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_forward_backward(dtype):
    k, x, (w, b, *_) = _inputs(1, 13, 200, dtype)
    ct = jax.random.normal(k[8], x.shape).astype(dtype)

    def vjp(fn):
        y, pull = jax.vjp(lambda x, w, b: fn(x, w, b, EPS, dtype), x, w, b)
        return y, pull(ct)

    _assert_close(vjp(pk.layer_norm), vjp(ops.layer_norm_reference), dtype, "layer_norm")


@pytest.mark.parametrize("branch_dtype", [jnp.float32, jnp.bfloat16])
def test_merge_rms_norm_forward_backward(branch_dtype):
    """The fused residual merge + RMSNorm: h is fp32, y in the compute dtype; all seven inputs get gradients."""
    k, _, (hs, hb, rs, rb, w, _) = _inputs(2, 1, 200, jnp.float32)
    hb, rb = 0.1 * hb, 0.1 * rb
    branch = jax.random.normal(k[7], (3, 5, 200)).astype(branch_dtype)
    residual = 4.0 * jax.random.normal(k[8], (3, 5, 200))
    dh = jax.random.normal(k[9], residual.shape)
    dy = jax.random.normal(k[0], residual.shape).astype(branch_dtype)

    def vjp(fn):
        out, pull = jax.vjp(lambda *a: fn(*a, EPS, branch_dtype), branch, residual, hs, hb, rs, rb, w)
        return out, pull((dh, dy))

    _assert_close(vjp(pk.merge_rms_norm), vjp(ops.merge_rms_norm_reference), branch_dtype, "merge_rms_norm")


def test_backward_row_loop_and_partials():
    """Several programs, each looping over several row tiles with a ragged last one, still sum dw exactly."""
    k, x, (w, *_) = _inputs(3, 37, 96, jnp.float32)
    dy = jax.random.normal(k[8], x.shape)
    launch = NormLaunch(rows=2, num_warps=1)
    y, rstd = kern.rms_forward(x, w, eps=EPS, out_dtype=jnp.float32, launch=launch, programs=5)
    dx, dw = kern.rms_backward(x, dy, rstd, w, launch=launch, programs=3)
    ref_y, pull = jax.vjp(lambda x, w: ops.rms_norm_reference(x, w, EPS), x, w)
    _assert_close((y, dx, dw), (ref_y, *pull(dy)), jnp.float32, "rms_norm rows loop")
    np.testing.assert_allclose(rstd, jax.lax.rsqrt(jnp.mean(x * x, -1) + EPS), rtol=1e-6)


def test_one_program_per_tile_and_multi_row_merge_partials():
    """programs_per_cu=0 (one tile per program, no loop) in forward and backward, and the merge backward's four
    [rows, D] accumulators over a ragged multi-row loop, against the references."""
    k, _, (hs, hb, rs, rb, w, _) = _inputs(6, 1, 72, jnp.float32)
    branch, residual = jax.random.normal(k[7], (11, 72)), 4.0 * jax.random.normal(k[8], (11, 72))
    dh, dy = jax.random.normal(k[9], residual.shape), jax.random.normal(k[0], residual.shape)
    ref_out, pull = jax.vjp(lambda *a: ops.merge_rms_norm_reference(*a, EPS, jnp.float32), branch, residual, hs, hb,
                            rs, rb, w)
    ref_grads = pull((dh, dy))
    # the kernel's bias gradients come out as sum(g * (branch + hb)), sum(g * (residual + rb)), sum(g): rebuild them
    for fwd_launch, bwd_launch, bwd_programs in ((NormLaunch(2, 1, 0), NormLaunch(3, 1, 0), None),
                                                 (NormLaunch(1, 1, 0), NormLaunch(2, 1, 2), 2)):
        h, y, rstd = kern.merge_forward(branch, residual, hs, hb, rs, rb, w, eps=EPS, out_dtype=jnp.float32,
                                        launch=fwd_launch)
        d_b, d_r, g_b, g_r, g_sum, g_w = kern.merge_backward(branch, residual, dh, dy, rstd, hs, hb, rs, rb, w,
                                                             launch=bwd_launch, programs=bwd_programs)
        got_grads = (d_b, d_r, g_b, hs * g_sum, g_r, rs * g_sum, g_w)
        _assert_close(((h, y), got_grads), (ref_out, ref_grads), jnp.float32, f"merge {fwd_launch} {bwd_launch}")
    with pytest.raises(ValueError, match="programs_per_cu"):
        kern.rms_forward(branch, w, eps=EPS, out_dtype=jnp.float32, launch=NormLaunch(1, 1, -1))


@pytest.mark.parametrize("prefetch", [0, 2, 3])
def test_merge_prefetch_depths(prefetch):
    """Tiles loaded 0, 2 or 3 steps ahead (3: more than the 3 steps a program walks, so the look-ahead clamps to
    the block's last tile) over ragged multi-row loops: same results as the references; bad depths are refused."""
    k, _, (hs, hb, rs, rb, w, _) = _inputs(7, 1, 72, jnp.float32)
    branch, residual = jax.random.normal(k[7], (11, 72)), 4.0 * jax.random.normal(k[8], (11, 72))
    dh, dy = jax.random.normal(k[9], residual.shape), jax.random.normal(k[0], residual.shape)
    ref_out, pull = jax.vjp(lambda *a: ops.merge_rms_norm_reference(*a, EPS, jnp.float32), branch, residual, hs, hb,
                            rs, rb, w)
    launch = NormLaunch(rows=2, num_warps=1, prefetch=prefetch)
    h, y, rstd = kern.merge_forward(branch, residual, hs, hb, rs, rb, w, eps=EPS, out_dtype=jnp.float32,
                                    launch=launch, programs=2)
    d_b, d_r, g_b, g_r, g_sum, g_w = kern.merge_backward(branch, residual, dh, dy, rstd, hs, hb, rs, rb, w,
                                                         launch=launch, programs=2)
    _assert_close(((h, y), (d_b, d_r, g_b, hs * g_sum, g_r, rs * g_sum, g_w)), (ref_out, pull((dh, dy))),
                  jnp.float32, f"merge prefetch={prefetch}")
    with pytest.raises(ValueError, match="prefetch"):
        NormLaunch(rows=1, num_warps=1, prefetch=-1)


def test_dispatch_through_ops():
    _, x, (w, b, *_) = _inputs(4, 6, 32, jnp.float32)
    _assert_close(ops.rms_norm(x, w, EPS, impl="pallas"), ops.rms_norm(x, w, EPS), jnp.float32, "ops.rms_norm")
    _assert_close(ops.layer_norm(x, w, b, EPS, impl="pallas"), ops.layer_norm(x, w, b, EPS), jnp.float32,
                  "ops.layer_norm")
    with pytest.raises(ValueError):
        ops.layer_norm(x, w, b, EPS, impl="nope")


# ------------------------------------------------------------------------------ inside shard_map (check_vma)
def _sharded_norm_grads(x, residual, branch, dy, vecs):
    """x, residual, dy: this shard's rows; branch (this shard's row count, the merge's first input) and the [D]
    parameters replicated (invariant), so their gradients are sums over the shards."""
    def loss(x, residual, branch, vecs):
        hs, hb, rs, rb, w, b = vecs
        y_rms = pk.rms_norm(x, w, EPS, jnp.float32)
        y_ln = pk.layer_norm(x, w, b, EPS, jnp.float32)
        h, y_merge = pk.merge_rms_norm(branch, residual, hs, hb, rs, rb, w, EPS, jnp.bfloat16)
        return jnp.sum((y_rms + y_ln + h + y_merge.astype(jnp.float32)) * dy)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, residual, branch, vecs)


def test_fwd_bwd_lower_for_cuda_inside_shard_map(monkeypatch):
    monkeypatch.setattr(platform, "interpret", lambda: False)
    _, x, vecs = _inputs(6, 8 * 24, 200, jnp.bfloat16)
    residual = dy = x.astype(jnp.float32)
    rows, whole = P("data"), P()
    text = vma.lower_in_shard_map_for_cuda(_sharded_norm_grads, (x, residual, x[:24], dy, tuple(vecs)),
                                            in_specs=(rows, rows, whole, rows, whole),
                                            out_specs=(rows, rows, whole, whole))
    for name in ("rms_norm", "layer_norm", "merge_rms_norm"):
        assert f'name = "{name}_fwd"' in text and f'name = "{name}_bwd"' in text, name
    assert text.count("__gpu$xla.gpu.triton") == 6
    # one sum per gradient of an invariant input: rms dw; layer norm dw, db; merge d_branch, hs, hb, rs, rb, w
    assert text.count("stablehlo.all_reduce") == 9


# ------------------------------------------------------------------------------------------- compiled (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_norms_at_zaya_shapes(dtype):
    rows, d = 16384 + 3, 2048  # the benchmark's shape plus a ragged tail of rows
    k, _, vecs = _inputs(5, 1, d, jnp.float32)
    branch = jax.random.normal(k[7], (rows, d)).astype(dtype)
    residual = 4.0 * jax.random.normal(k[8], (rows, d))
    dh = jax.random.normal(k[9], residual.shape)
    dy = jax.random.normal(k[0], residual.shape).astype(dtype)
    hs, hb, rs, rb, w, b = vecs

    # Arrays travel as arguments: closed-over device arrays would be baked into the program as constants.
    @functools.partial(jax.jit, static_argnums=0)
    def merge_vjp(fn, branch, residual, dh, dy, vecs):
        out, pull = jax.vjp(lambda *a: fn(*a, EPS, dtype), branch, residual, *vecs)
        return out, pull((dh, dy))

    @functools.partial(jax.jit, static_argnums=0)
    def rms_vjp(fn, x, dy, w):
        y, pull = jax.vjp(lambda x, w: fn(x, w, EPS, dtype), x, w)
        return y, pull(dy)

    @functools.partial(jax.jit, static_argnums=0)
    def ln_vjp(fn, x, dy, w, b):
        y, pull = jax.vjp(lambda x, w, b: fn(x, w, b, EPS, dtype), x, w, b)
        return y, pull(dy)

    merge_args = (branch, residual, dh, dy, (hs, hb, rs, rb, w))
    _assert_close(merge_vjp(pk.merge_rms_norm, *merge_args), merge_vjp(ops.merge_rms_norm_reference, *merge_args),
                  dtype, "gpu merge")
    _assert_close(rms_vjp(pk.rms_norm, residual, dy, w), rms_vjp(ops.rms_norm_reference, residual, dy, w), dtype,
                  "gpu rms")
    _assert_close(ln_vjp(pk.layer_norm, residual, dy, w, b), ln_vjp(ops.layer_norm_reference, residual, dy, w, b),
                  dtype, "gpu layer_norm")

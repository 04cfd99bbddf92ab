"""The QK norm + RoPE kernel against the jnp reference: interpret mode on the CPU, compiled with `-m gpu`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import platform, vma
from pallas_kernels import qk_norm_rope as pk
from zaya_jax.ops import qk_norm_rope as ops


def _inputs(seed, B, T, heads, kv, d, r, dtype, offset=0):
    k = jax.random.split(jax.random.key(seed), 4)
    qk = (2.0 * jax.random.normal(k[0], (B, T, heads + kv, d)) + 0.3).astype(dtype)
    qk = qk.at[0, 0, 1].set(0)  # a zero head (a padded token): the clamped norm
    temp = jax.random.uniform(k[1], (kv,), minval=0.5, maxval=1.5)
    positions = offset + jax.random.randint(k[2], (B, T), 0, 4096)
    cos, sin = ops.rope_tables(positions, ops.rope_inv_freq(10000.0, 2 * r), dtype)
    ct = jax.random.normal(k[3], (B, T, heads + kv, d))
    return qk, temp, cos, sin, (ct[:, :, :heads].astype(dtype), ct[:, :, heads:].astype(dtype))


pk_kernel = ops.qk_norm_rope_kernel


def _vjp(fn, qk, temp, cos, sin, heads, ct):
    out, pull = jax.vjp(lambda qk, temp: fn(qk, temp, cos, sin, heads), qk, temp)
    return out, pull(ct)


def _assert_as_accurate_as_xla(fn, qk, temp, cos, sin, heads):
    """bf16: the kernel rounds where the Hugging Face reference rounds (the normalised head, each product of the
    rotation, their sum), while XLA may keep an fp32 intermediate in a fusion, so the two need not agree bit for
    bit; each must be as close to the fp32 computation on the same bf16 inputs as the other."""
    truth = ops.qk_norm_rope_reference(qk.astype(jnp.float32), temp, cos.astype(jnp.float32),
                                       sin.astype(jnp.float32), heads)
    for got, want, exact in zip(fn(pk_kernel, qk, temp, cos, sin, heads), fn(ops.qk_norm_rope_reference, qk, temp, cos,
                                                                          sin, heads), truth):
        assert got.dtype == want.dtype == jnp.bfloat16
        err = [np.abs(np.asarray(x, np.float32) - np.asarray(exact)) for x in (got, want)]
        assert err[0].max() <= 2 * err[1].max() and err[0].mean() <= 1.5 * err[1].mean(), (
            f"kernel max / mean error {err[0].max():.2e} / {err[0].mean():.2e} against XLA's "
            f"{err[1].max():.2e} / {err[1].mean():.2e}")


# (B, T, H, KV, d, r): rows not a multiple of the row tile; partial rotary (a pass-through block) and full rotary
CASES = [(2, 21, 4, 2, 32, 8), (1, 7, 2, 1, 16, 8)]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_fp32(case):
    B, T, H, KV, d, r = case
    qk, temp, cos, sin, ct = _inputs(0, B, T, H, KV, d, r, jnp.float32)
    (got, g_grads), (want, w_grads) = (_vjp(f, qk, temp, cos, sin, H, ct)
                                       for f in (pk_kernel, ops.qk_norm_rope_reference))
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
    for a, b in zip(g_grads, w_grads):  # the backward is the reference's
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_forward_bf16_as_accurate_as_xla():
    B, T, H, KV, d, r = CASES[0]
    _assert_as_accurate_as_xla(lambda fn, *a: fn(*a), *_inputs(1, B, T, H, KV, d, r, jnp.bfloat16, offset=100_000)[:4],
                               H)


def test_shapes_triton_cannot_tile_use_the_reference():
    qk, temp, cos, sin, _ = _inputs(2, 1, 5, 2, 1, 24, 6, jnp.float32)
    assert not pk.supported(24, 6)
    for a, b in zip(pk_kernel(qk, temp, cos, sin, 2), ops.qk_norm_rope_reference(qk, temp, cos, sin, 2)):
        np.testing.assert_array_equal(a, b)


def test_unknown_impl_is_named():
    qk, temp, cos, sin, _ = _inputs(3, 1, 3, 2, 1, 16, 4, jnp.float32)
    with pytest.raises(ValueError, match="QK norm impl 'triton' unknown"):
        ops.qk_norm_rope(qk, temp, cos, sin, 2, impl="triton")


def test_lowers_for_cuda_inside_shard_map(monkeypatch):
    """Rows sharded, temp replicated: the kernel lowers under check_vma and temp's gradient is summed."""
    monkeypatch.setattr(platform, "interpret", lambda: False)
    qk, temp, cos, sin, ct = _inputs(4, 8, 16, 8, 2, 128, 32, jnp.bfloat16)

    def grads(qk, temp, cos, sin, ct):
        return _vjp(pk_kernel, qk, temp, cos, sin, 8, ct)

    rows = P("data")
    text = vma.lower_in_shard_map_for_cuda(grads, (qk, temp, cos, sin, ct), in_specs=(rows, P(), rows, rows, rows),
                                            out_specs=((rows, rows), (rows, P())))
    assert 'name = "qk_norm_rope"' in text
    assert text.count("stablehlo.all_reduce") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_at_zaya_shapes(dtype):
    """ZAYA1's CCA heads (8 query + 2 key heads of 128, rotary dim 64) over a ragged number of positions."""
    qk, temp, cos, sin, _ = _inputs(5, 3, 1000 + 3, 8, 2, 128, 32, dtype)
    run = functools.partial(jax.jit, static_argnums=(0, 5))(lambda fn, *a: fn(*a))
    if dtype == jnp.bfloat16:
        _assert_as_accurate_as_xla(run, qk, temp, cos, sin, 8)
        return
    for a, b in zip(run(pk_kernel, qk, temp, cos, sin, 8), run(ops.qk_norm_rope_reference, qk, temp, cos, sin, 8)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

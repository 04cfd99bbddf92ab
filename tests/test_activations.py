"""The exact GELU of the router (and of hidden_act='gelu'): jax.nn.gelu's values and gradients, and a gradient that
type-checks inside shard_map on every tested jax (0.12's own erfc derivative does not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from zaya_jax.model.base import activation, gelu_exact


def _points(dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(2000) * s for s in (0.1, 1.0, 3.0, 8.0)] + [np.linspace(-12, 12, 2001)])
    return jnp.asarray(x, dtype), jnp.asarray(rng.standard_normal(x.shape), dtype)


def _vjp(f, x, ct):
    return jax.jit(lambda x, ct: jax.vjp(f, x)[1](ct)[0])(x, ct)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_are_jax_nn_gelus(dtype):
    assert activation("gelu") is gelu_exact
    ref = lambda x: jax.nn.gelu(x, approximate=False)
    x, ct = _points(dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(gelu_exact)(x)), np.asarray(jax.jit(ref)(x)))
    got, want = (np.asarray(_vjp(f, x, ct), np.float32) for f in (gelu_exact, ref))
    if jax.__version_info__ < (0, 12):
        np.testing.assert_array_equal(got, want)  # the same operations as 0.11.2's erfc rule
    else:  # 0.12 evaluates exp(-z^2) more exactly: within one rounding of the result
        eps = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(got, want, rtol=eps, atol=eps * float(np.abs(want).max()))


def test_gradient_inside_shard_map_with_the_vma_check():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    x, _ = _points(jnp.float32)
    x = x[:8 * 1000].reshape(8, 1000)
    grad = jax.grad(lambda y: gelu_exact(y).sum())
    sharded = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(jax.jit(grad)(x)))

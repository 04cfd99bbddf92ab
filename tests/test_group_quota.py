"""Each group's quota of its highest keys, ties in token order (ops/group_quota.py): the Pallas cutoffs
(pallas_kernels/group_quota.py, interpret mode here) keep exactly the tokens the sort's ranks keep, on fresh random
keys with many ties, -inf keys (padding), tokens of no group, and quotas of zero, below, at and above a group's size;
their Triton lowering inside shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import platform, vma
from zaya_jax.ops import group_quota
from zaya_jax.ops.balancing_solve import order_keys


def case(n, groups, rng):
    values = rng.normal(size=n) * rng.choice([1e-4, 1.0, 1e3])
    values[rng.random(n) < 0.3] = np.round(values.mean(), 1)  # a crowd of equal keys
    values = np.where(rng.random(n) < 0.5, np.round(values, 1), values)  # more ties
    values[rng.random(n) < 0.1] = -np.inf
    group = rng.integers(0, groups + 1, n)  # `groups`: no group
    sizes = np.bincount(group, minlength=groups + 1)[:groups]
    quota = np.array([rng.choice([0, 1, s // 3, s - 1, s, s + 2]) for s in sizes]).clip(0)
    return order_keys(jnp.asarray(values, jnp.float32)), jnp.asarray(group, jnp.int32), jnp.asarray(quota, jnp.int32)


@pytest.mark.parametrize("n, groups", [(512, 16), (3000, 5), (2048, 1)])
def test_kernel_keeps_the_tokens_the_sort_keeps(n, groups):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        keys, group, quota = case(n, groups, rng)
        want = np.asarray(jax.jit(lambda *a: group_quota.kept(*a, impl="xla"))(keys, group, quota))
        got = np.asarray(jax.jit(lambda *a: group_quota.kept(*a, impl="pallas"))(keys, group, quota))
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
        g = np.asarray(group)
        kept_per_group = np.bincount(g[want & (g < groups)], minlength=groups)
        assert np.all(kept_per_group == np.minimum(np.asarray(quota), np.bincount(g, minlength=groups + 1)[:groups]))


def test_kernel_lowers_for_cuda_inside_shard_map(monkeypatch):
    monkeypatch.setattr(platform, "interpret", lambda: False)

    def per_rank(keys, group, quota):
        return group_quota.kept(keys[0], group[0], quota[0], impl="pallas")[None]

    text = vma.lower_in_shard_map_for_cuda(
        per_rank, (jnp.zeros((8, 8192), jnp.int32), jnp.zeros((8, 8192), jnp.int32), jnp.zeros((8, 16), jnp.int32)),
        in_specs=(P("data"),) * 3, out_specs=P("data"))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gpu_kernel_keeps_the_tokens_the_sort_keeps():
    """The bench preset's hand-on size (8192 tokens, 16 experts) compiled for the GPU."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    keys, group, quota = case(8192, 16, np.random.default_rng(seed))
    want = jax.jit(lambda *a: group_quota.kept(*a, impl="xla"))(keys, group, quota)
    got = jax.jit(lambda *a: group_quota.kept(*a, impl="pallas"))(keys, group, quota)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")

"""The order-statistics kernel (pallas_kernels/order_statistics.py) against the sort (ops/order_statistics.py) on
fresh random rows with ties and -inf, at every k; the balancing solve with either; its Triton lowering inside
shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import platform, vma
from zaya_jax.model import routing_stats
from zaya_jax.ops.order_statistics import kth_and_next_largest


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return np.random.default_rng(seed), seed


def check_rows(rows, n, rng):
    x = np.round(rng.normal(size=(rows, n)) * 4) / 4  # a coarse grid: many ties
    x[rng.random(x.shape) < 0.2] = -np.inf  # the solve's invalid tokens
    x = jnp.asarray(x, jnp.float32)
    for k in sorted(set(rng.integers(1, n - 1, 6).tolist()) | {1, n - 1}):
        expected = kth_and_next_largest(x, k, impl="xla")
        got = jax.jit(lambda x, k: kth_and_next_largest(x, k, impl="pallas"))(x, k)
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=f"k={k}")


@pytest.mark.parametrize("rows,n", [(16, 2048), (5, 300), (3, 40)])
def test_counting_picks_what_the_sort_picks(rows, n):
    rng, seed = fresh_rng()
    try:
        check_rows(rows, n, rng)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}") from err


def test_balancing_solve_is_the_same_with_either():
    rng, seed = fresh_rng()
    n, e = 3 * routing_stats.SOLVE_TOKENS // 2, 16
    scores = jnp.asarray(1 / 17 + rng.normal(size=e) * 1e-3 + rng.normal(size=(n, e)) * 1e-4, jnp.float32)
    valid = jnp.asarray(rng.random(n) < 0.8)
    solve = jax.jit(routing_stats.balancing_correction, static_argnums=2)
    # the same order statistics every round: only the rounding of each round's zero-mean shift may differ
    np.testing.assert_allclose(solve(scores, valid, "pallas"), solve(scores, valid, "xla"), rtol=0, atol=1e-9,
                               err_msg=f"seed {seed}")


def test_counting_lowers_for_cuda_inside_shard_map(monkeypatch):
    monkeypatch.setattr(platform, "interpret", lambda: False)

    def per_rank(x):
        return jnp.stack(kth_and_next_largest(x[0], 128, impl="pallas"))[None]

    text = vma.lower_in_shard_map_for_cuda(per_rank, (jnp.zeros((8, 16, 2048)),), in_specs=(P("data"),),
                                            out_specs=P("data"))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gpu_counting_picks_what_the_sort_picks():
    rng, seed = fresh_rng()
    try:
        check_rows(16, 2048, rng)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}") from err

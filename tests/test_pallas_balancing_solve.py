"""The balancing solve kernels (pallas_kernels/balancing_solve.py) against their jnp reference
(ops/balancing_solve.py) on fresh random router scores: nearly uniform, collapsed onto one expert, clustered, padded,
ties, negative and mixed-sign scores, and expert and token counts that are not powers of two; their Triton lowering
inside shard_map; the size they refuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import platform, vma
from zaya_jax.config import preset
from zaya_jax.model import routing_stats
from zaya_jax.ops.balancing_solve import solve

CONSTANTS = dict(rounds=routing_stats.SOLVE_ROUNDS, damping=routing_stats.SOLVE_DAMPING,
                 momentum=routing_stats.SOLVE_MOMENTUM)


def scores_of(case, e, n, rng, spread=1e-4):
    base = 1 / (e + 1) + rng.normal(size=(e, 1)) * (1e-3 if case == "collapsed" else spread)
    scores = base + rng.normal(size=(e, n)) * spread
    if case == "clustered":  # 60% of the tokens in six tight clusters, as a trained router puts them
        cluster = rng.integers(0, 10, n)
        centers = rng.normal(size=(e, 6)) * 3 * spread
        tight = cluster < 6
        scores[:, tight] = centers[:, cluster[tight]] + rng.normal(size=(e, tight.sum())) * 0.05 * spread
    if case == "ties":  # scores on a coarse grid: many equal margins at every expert's threshold
        scores = np.round(scores / spread * 4) * spread / 4
    if case == "signed":  # biases far below zero and scores of both signs: every bit of the keys is searched
        scores = scores - 1 / (e + 1) + rng.normal(size=(e, 1)) * 3
    return jnp.asarray(scores, jnp.float32)


def check_kernel_matches_reference(case, e, n, padded, rng, start="median"):
    scores = scores_of(case, e, n, rng)
    valid = jnp.asarray(rng.random(n) < 0.6) if padded else jnp.ones(n, bool)
    reference = jax.jit(lambda s, v: solve(s, v, impl="xla", start=start, **CONSTANTS))(scores, valid)
    kernel = jax.jit(lambda s, v: solve(s, v, impl="pallas", start=start, **CONSTANTS))(scores, valid)
    # the same order statistics every round: only the rounding of the zero-mean shift may differ
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), rtol=0, atol=1e-4 * 1e-4)
    index = np.argmax(np.asarray(scores + kernel[:, None]), 0)[np.asarray(valid)]
    share = np.bincount(index, minlength=e) / index.size * e
    # each expert is solved to valid // E tokens: the remainder lands somewhere, two tokens' share of slack
    assert share.max() <= (1.5 if case in ("clustered", "ties") else 1.1 + 2 * e / index.size), share


# two shapes (each compiles both solves, about 10 s on 2 cores in interpret mode): 16 x 2048 (five cases share its
# programs) and 5 x 1000 (expert and token counts that are not powers of two)
@pytest.mark.parametrize("case,e,n,padded", [
    ("nearly_uniform", 16, 2048, False), ("collapsed", 16, 2048, True), ("clustered", 16, 2048, False),
    ("ties", 16, 2048, False), ("nearly_uniform", 5, 1000, True), ("signed", 16, 2048, True)])
def test_kernel_picks_the_reference_order_statistics(case, e, n, padded):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    try:
        check_kernel_matches_reference(case, e, n, padded, np.random.default_rng(seed))
    except AssertionError as err:
        raise AssertionError(f"seed {seed}") from err


def test_kernel_matches_reference_from_the_stored_biases():
    """start='zero' (the rounds from the biases as they are, no median kernel): the same order statistics."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    try:
        check_kernel_matches_reference("nearly_uniform", 5, 1000, True, np.random.default_rng(seed), start="zero")
    except AssertionError as err:
        raise AssertionError(f"seed {seed}") from err


@pytest.mark.parametrize("tokens", [256, 4096])  # the whole forward, and a subset of SOLVE_TOKENS of it
def test_router_routes_the_same_tokens_with_the_kernel(tokens):
    """The train step's selection (balance_tokens) through the kernel, jitted, equals the reference's."""
    from flax import nnx
    from zaya_jax.model.router import Router
    cfg = preset("tiny", dtype="float32")
    x = jax.random.normal(jax.random.key(int(np.random.SeedSequence().entropy % 2**31)), (4, tokens // 4,
                                                                                       cfg.hidden_size))
    state = jnp.zeros((*x.shape[:2], cfg.router_hidden_size))
    scale = jnp.ones((cfg.router_hidden_size,))
    routed = {}
    for impl in ("xla", "pallas"):
        router = Router(cfg.replace(solve_impl=impl), nnx.Rngs(0))
        router.balance_tokens = True
        graphdef, params = nnx.split(router)
        _, index, _, _, correction, _ = jax.jit(lambda p: nnx.merge(graphdef, p)(x, state, scale))(params)
        routed[impl] = np.asarray(index), np.asarray(correction)
    np.testing.assert_allclose(routed["pallas"][1], routed["xla"][1], rtol=0, atol=1e-8)
    assert np.mean(routed["pallas"][0] == routed["xla"][0]) >= 0.999
    counts = np.bincount(routed["pallas"][0].ravel(), minlength=cfg.num_experts + 1)
    assert counts[-1] == 0 and counts[:-1].tolist() == [tokens // cfg.num_experts] * cfg.num_experts, counts


def test_kernel_takes_no_gradient_and_refuses_what_it_cannot_hold():
    scores = scores_of("nearly_uniform", 8, 64, np.random.default_rng(0))
    grad = jax.grad(lambda s: solve(s, jnp.ones(64, bool), impl="pallas", **CONSTANTS).sum() + s.sum())(scores)
    assert np.all(np.asarray(grad) == 1.0)
    with pytest.raises(ValueError, match="SOLVE_TOKENS"):
        solve(jnp.zeros((16, 8192)), jnp.ones(8192, bool), impl="pallas", **CONSTANTS)


@pytest.mark.parametrize("start", ["median", "zero"])
def test_kernel_lowers_for_cuda_inside_shard_map(monkeypatch, start):
    monkeypatch.setattr(platform, "interpret", lambda: False)

    def per_rank(scores, valid):
        return solve(scores[0], valid[0], impl="pallas", start=start, **CONSTANTS)[None]

    text = vma.lower_in_shard_map_for_cuda(per_rank, (jnp.zeros((8, 16, 2048)), jnp.ones((8, 2048), bool)),
                                            in_specs=(P("data"), P("data")), out_specs=P("data"))
    # the medians (for their start), then one launch per round
    assert text.count("__gpu$xla.gpu.triton") == (start == "median") + CONSTANTS["rounds"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nearly_uniform", "clustered", "ties"])
def test_gpu_kernel_picks_the_reference_order_statistics(case):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    try:
        check_kernel_matches_reference(case, 16, 2048, case == "ties", np.random.default_rng(seed))
    except AssertionError as err:
        raise AssertionError(f"seed {seed}") from err


def test_search_finds_the_sorted_key_on_hard_inputs():
    """The kernels' order-statistic search (plain jnp, so it runs here as it does inside a program) against a sort,
    on keys that defeat a value bisection: values from 1e-38 to 1e38 of both signs, subnormals, signed zeros, one
    value repeated, two clusters far apart, -inf (invalid) keys; every rank, with the count of keys at or above it;
    without a guess, from a guess that holds the answer, one that misses it, and a NaN one (a first round)."""
    from pallas_kernels._order_search import key_value, largest, order_key
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    n = 257
    cases = {
        "wide": rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-38, 38, n),
        "subnormal": rng.normal(size=n) * 1e-42,
        "zeros": rng.choice([0.0, -0.0, 1e-45, -1e-45], n),
        "repeated": np.full(n, 0.1),
        "clusters": np.where(rng.random(n) < 0.5, 1e6, -1e6) + rng.normal(size=n) * 1e-2,
        "invalid": np.where(rng.random(n) < 0.7, -np.inf, rng.normal(size=n)),
    }
    search = jax.jit(lambda keys, rank, guess: largest([keys], rank, guess))
    plain = jax.jit(lambda keys, rank: largest([keys], rank))
    for name, values in cases.items():
        keys = order_key(jnp.asarray(values, jnp.float32))
        ranked = np.sort(np.asarray(keys))[::-1]
        for rank in [1, 2, n // 3, n // 2, n - 1, n]:
            want = ranked[rank - 1]
            value = float(key_value(jnp.int32(want)))
            guesses = {"holds": (value - abs(value) * 1e-3, value + abs(value) * 1e-3 + 1e-44),
                       "misses": (value + abs(value) + 1.0, value + abs(value) + 2.0), "nan": (np.nan, np.nan)}
            results = {"none": plain(keys, jnp.int32(rank))}
            results.update({g: search(keys, jnp.int32(rank), tuple(jnp.float32(v) for v in guess))
                            for g, guess in guesses.items()})
            for how, (found, at_or_above) in results.items():
                assert int(found) == want, (name, rank, how, seed)
                assert int(at_or_above) == int(np.sum(ranked >= want)), (name, rank, how, seed)

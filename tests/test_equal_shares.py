"""Equal expert shares (model/equal_shares.py) against a plain-loop replay of the same greedy assignment, on fresh
random scores with padding tokens and tokens routed to the skip class, and its invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model.equal_shares import BIDDER_FRACTION, REFILL_ROUNDS, equal_shares


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return np.random.default_rng(seed), seed


def replay(scores, index, valid):
    """The assignment token by token: shares, the over-full experts' lowest margins handed on (padding first),
    REFILL_ROUNDS rounds of bids by the first n // BIDDER_FRACTION of them for the best expert with room (highest
    score wins), the rest in token order."""
    n, E = scores.shape
    routed = index < E
    counts = np.bincount(index[routed], minlength=E)
    total = counts.sum()
    place = np.empty(E, int)
    place[sorted(range(E), key=lambda e: (-counts[e], e))] = np.arange(E)
    share = total // E + (place < total % E)
    new = index.copy()
    moving = []
    for e in range(E):
        mine = [t for t in range(n) if index[t] == e]
        margin = {t: scores[t, e] - np.delete(scores[t], e).max() if valid[t] else -np.inf for t in mine}
        mine.sort(key=lambda t: (-margin[t], t))
        moving += mine[share[e]:]
    moving.sort()
    room = share - np.minimum(counts, share)
    bidding = moving[:max(1, n // BIDDER_FRACTION)]
    for _ in range(REFILL_ROUNDS):
        target = {t: max((e for e in range(E) if room[e] > 0), key=lambda e: (scores[t, e], -e)) for t in bidding}
        won = []
        for e in range(E):
            bidders = sorted((t for t in bidding if target[t] == e),
                             key=lambda t: (-(scores[t, e] if valid[t] else -np.inf), t))
            won += bidders[:room[e]]
            for t in bidders[:room[e]]:
                new[t] = e
            room[e] -= len(bidders[:room[e]])
        bidding = [t for t in bidding if t not in won]
        moving = [t for t in moving if t not in won]
    for t in moving:
        e = int(np.flatnonzero(room > 0)[0])
        new[t], room[e] = e, room[e] - 1
    return new


# expert offsets of 2e-3 hand on more tokens than bid (the rest fill), 1e-4 fewer (every one bids)
@pytest.mark.parametrize("n, experts, offset", [(96, 4, 2e-3), (250, 8, 2e-3), (250, 8, 1e-4)])
@pytest.mark.parametrize("impl", ["xla", "pallas"])  # the hand-on's cutoffs by a sort or by the Pallas search
def test_shares_are_equal_and_match_the_replay(n, experts, offset, impl):
    rng, seed = fresh_rng()
    scores = (rng.normal(size=(n, experts)) * 1e-3 + rng.normal(size=experts) * offset).astype(np.float32)
    index = scores.argmax(-1)
    index[rng.random(n) < 0.05] = experts  # the skip class
    valid = rng.random(n) < 0.9
    new, moved = jax.jit(lambda *a: equal_shares(*a, impl=impl))(jnp.asarray(scores), jnp.asarray(index, jnp.int32),
                                                                 jnp.asarray(valid))
    new, moved = np.asarray(new), np.asarray(moved)
    np.testing.assert_array_equal(new, replay(scores, index, valid), err_msg=f"seed {seed}")
    routed = index < experts
    counts = np.bincount(new[routed], minlength=experts)
    assert counts.max() - counts.min() <= 1 and counts.sum() == routed.sum(), (counts, f"seed {seed}")
    np.testing.assert_array_equal(new[~routed], experts)
    np.testing.assert_array_equal(moved, new != index)
    before = np.bincount(index[routed], minlength=experts)
    assert not np.any(moved & routed & (before[np.minimum(index, experts - 1)] <= counts.max() - 1)), f"seed {seed}"


def test_handed_on_tokens_are_the_least_attached_padding_first():
    rng, seed = fresh_rng()
    n, experts = 64, 4
    scores = rng.normal(size=(n, experts)).astype(np.float32) * 1e-2
    scores[:, 0] += 1e-2  # expert 0 leads most tokens
    index = scores.argmax(-1)
    valid = np.ones(n, bool)
    valid[rng.choice(np.flatnonzero(index == 0), 3, replace=False)] = False
    new, moved = map(np.asarray, equal_shares(jnp.asarray(scores), jnp.asarray(index, jnp.int32), jnp.asarray(valid)))
    out = moved & (index == 0)
    assert np.all(out[~valid]), f"seed {seed}"
    stay = ~moved & (index == 0)
    margin = scores[:, 0] - scores[:, 1:].max(-1)
    assert margin[stay].min() >= margin[out & valid].max(), f"seed {seed}"


def test_balanced_forward_is_left_alone():
    index = jnp.arange(64, dtype=jnp.int32) % 8
    scores = jax.nn.one_hot(index, 8) + 0.01 * jax.random.normal(jax.random.key(0), (64, 8))
    new, moved = equal_shares(scores, index, jnp.ones(64, bool))
    np.testing.assert_array_equal(new, index)
    assert not np.any(moved)


def sorts_in(jaxpr) -> int:
    from jax.extend.core import jaxprs_in_params
    return sum(1 if e.primitive.name == "sort" else sum(sorts_in(j) for j in jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_the_backward_reuses_the_forward_routing(remat):
    """The remat policies keep the balancing correction and the final experts, so the backward's recomputation of a
    layer neither solves nor shares out again: the gradient program sorts as often as the forward alone."""
    from flax import nnx
    from hf_reference.jax_side import random_model
    from zaya_jax.config import preset
    from zaya_jax.train.step import make_loss_fn
    model = random_model(preset("tiny", num_hidden_layers=2, dtype="float32", remat=remat, moe_impl="dense"), seed=3)
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 500, (2, 33)), jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((2, 32), jnp.float32),
             "source_ids": jnp.zeros((2,), jnp.int32)}
    loss = make_loss_fn(graphdef, reset_at_documents=False)
    forward = sorts_in(jax.make_jaxpr(loss)(params, model_state, batch).jaxpr)
    both = sorts_in(jax.make_jaxpr(jax.grad(lambda p: loss(p, model_state, batch)[0]))(params).jaxpr)
    assert forward > 0 and both == forward, (forward, both)

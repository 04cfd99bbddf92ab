"""Sampling filters and draws: top-k keeps the k best (ties included), top-p keeps HF's set (smallest prefix of
the sorted distribution reaching mass p, at least one token), temperature sampling draws from softmax(logits/T),
greedy is the argmax, and a stopped row emits pad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.inference.sampling import (
    GREEDY,
    Sampling,
    choose,
    filtered_logits,
    top_k_filter,
    top_p_filter,
)


def hf_top_p_keep(logits: np.ndarray, p: float) -> np.ndarray:
    """HF's rule written out: sort ascending, drop tokens whose cumulative mass (inclusive) is <= 1 - p, keep the
    last (best) token always."""
    order = np.argsort(logits)
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    drop = np.cumsum(probs) <= 1 - p
    drop[-1] = False
    keep = np.ones_like(logits, bool)
    keep[order[drop]] = False
    return keep


def test_top_k_keeps_the_k_best_and_ties():
    logits = jnp.array([[1.0, 5.0, 3.0, 3.0, -2.0]])
    kept = np.isfinite(np.asarray(top_k_filter(logits, 3)))[0]
    np.testing.assert_array_equal(kept, [False, True, True, True, False])
    kept = np.isfinite(np.asarray(top_k_filter(logits, 2)))[0]
    np.testing.assert_array_equal(kept, [False, True, True, True, False])  # the tie at the k-th value stays


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6, 0.9, 0.999])
def test_top_p_matches_hf_rule(p):
    logits = np.asarray(jax.random.normal(jax.random.key(0), (6, 50)) * 2.0)
    kept = np.isfinite(np.asarray(top_p_filter(jnp.asarray(logits), p)))
    for row in range(logits.shape[0]):
        np.testing.assert_array_equal(kept[row], hf_top_p_keep(logits[row], p))


def test_temperature_sampling_follows_softmax():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    T = 2.0
    draws = choose(jnp.broadcast_to(logits, (40000, 4)), jax.random.key(1), Sampling(temperature=T))
    freq = np.bincount(np.asarray(draws), minlength=4) / draws.shape[0]
    want = np.asarray(jax.nn.softmax(logits / T))
    np.testing.assert_allclose(freq, want, atol=0.01)


def test_filters_compose_and_greedy_is_argmax():
    logits = jnp.array([[0.0, 4.0, 3.9, 1.0, 2.0]])
    f = filtered_logits(logits, Sampling(temperature=0.5, top_k=3, top_p=0.6))  # p(best) = 0.54
    np.testing.assert_array_equal(np.isfinite(np.asarray(f))[0], [False, True, True, False, False])
    np.testing.assert_allclose(np.asarray(f)[0, 1:3], [8.0, 7.8])
    assert int(choose(logits, jax.random.key(0), GREEDY)[0]) == 1
    draws = choose(jnp.broadcast_to(logits, (500, 5)), jax.random.key(2), Sampling(temperature=1.0, top_k=2))
    assert set(np.unique(np.asarray(draws))) == {1, 2}


def test_invalid_settings_are_refused():
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampling(**bad)

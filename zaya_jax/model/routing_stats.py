"""Per-layer routing statistics of a forward, in one flat fp32 vector per layer [4 E + 6] that adds across
data-parallel ranks with one psum (sums over the counted tokens, padding excluded):

    counts       [E+1]  tokens routed to each class (last = skip)
    prob_sum     [E+1]  sum of each class's softmax probability
    prob_sq_sum  [E+1]  sum of its square (with prob_sum: the token-to-token spread of the probabilities)
    top1_sum     []     sum of the largest probability (how confident the router is)
    entropy_sum  []     sum of the softmax entropy in nats (log(E+1) = uniform)
    correction   [E]    the zero-mean change of the E expert biases that would have given every expert the same
                        number of this forward's tokens (balancing_correction), summed over the ranks
    ranks        []     1 per forward (the psum makes it the number of ranks the correction was summed over)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name


class RoutingStats(NamedTuple):
    counts: jax.Array
    prob_sum: jax.Array
    prob_sq_sum: jax.Array
    top1_sum: jax.Array
    entropy_sum: jax.Array
    correction: jax.Array
    ranks: jax.Array

    @property
    def tokens(self):
        return self.counts.sum(-1)


# Jacobi rounds of the balancing solve and the share of each round's step taken: converges to within a token or two
# of equal counts from a fully collapsed router as well as from a nearly uniform one (tests/test_balancing.py).
# The solve reads at most SOLVE_TOKENS tokens, a fixed random subset (its sorts would otherwise cost a sizeable part
# of an expert layer; a regular stride aliases with periodic text such as indented code): each expert's share of the
# forward is then off by the sampling error of SOLVE_TOKENS / E tokens, about 1 / sqrt(that).
SOLVE_ROUNDS = 16
SOLVE_TOKENS = 2048
SOLVE_DAMPING = 0.7
CORRECTION_NAME = "balancing_correction"  # its checkpoint_name: remat policies keep it (model/zaya.py)


def balancing_correction(scores, valid):
    """scores [N, E] (each real expert's probability plus its balancing bias), valid [N] bool -> the zero-mean
    bias change delta [E] after which argmax(scores + delta) gives each expert about N/E of the valid tokens
    (estimated on at most SOLVE_TOKENS of them).

    Each round sets every expert's delta so that exactly N/E tokens prefer it to their best other expert (the
    midpoint of its N/E-th and next-largest margins), all experts at once, damped; the margins are measured in
    the scores' own units, so the solve needs no step size whatever the spread of the probabilities."""
    if scores.shape[0] > SOLVE_TOKENS:
        subset = np.sort(np.random.default_rng(scores.shape[0]).choice(scores.shape[0], SOLVE_TOKENS, replace=False))
        scores, valid = scores[subset], valid[subset]
    n, num_experts = scores.shape
    k = jnp.clip(valid.sum() // num_experts, 1, n - 1)
    experts = jnp.arange(num_experts)

    def round_(delta, _):
        s = scores + delta
        first = s.max(-1, keepdims=True)
        is_first = experts[None] == jnp.argmax(s, -1)[:, None]
        second = jnp.where(is_first, -jnp.inf, s).max(-1, keepdims=True)
        best_other = jnp.where(is_first, second, first)
        margin = jnp.where(valid[:, None], s - best_other, -jnp.inf)
        ranked = -jnp.sort(-margin, axis=0)
        middle = 0.5 * (jnp.take(ranked, k - 1, axis=0) + jnp.take(ranked, k, axis=0))
        middle = jnp.where(jnp.isfinite(middle), middle, 0.0)
        delta = delta - SOLVE_DAMPING * middle
        return delta - delta.mean(), None

    # the carry starts from the scores (not a constant) so that inside shard_map it varies over the same axes
    delta, _ = jax.lax.scan(round_, jnp.zeros_like(scores[0]), None, length=SOLVE_ROUNDS)
    return checkpoint_name(jnp.where(valid.sum() >= num_experts, delta, 0.0), CORRECTION_NAME)


def token_sums(probs, index, correction, token_mask=None) -> jax.Array:
    """probs [..., E+1] fp32, index [...], correction [E] -> the flat statistics vector [4 E + 6] of these tokens."""
    classes = probs.shape[-1]
    probs = jax.lax.stop_gradient(probs.astype(jnp.float32))
    weight = jnp.ones(index.shape, jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    w = weight[..., None]
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    axes = tuple(range(index.ndim))
    return jnp.concatenate([
        (jax.nn.one_hot(index, classes, dtype=jnp.float32) * w).sum(axes),
        (probs * w).sum(axes),
        (probs * probs * w).sum(axes),
        (probs.max(-1) * weight).sum(axes)[None],
        (entropy * weight).sum(axes)[None],
        jax.lax.stop_gradient(correction).astype(jnp.float32),
        jnp.ones((1,), jnp.float32),
    ])


def unpack(stats) -> RoutingStats:
    """[..., 4 E + 6] -> RoutingStats of [..., E+1] / [..., E] / [...] arrays."""
    stats = jnp.asarray(stats, jnp.float32)
    experts = (stats.shape[-1] - 6) // 4
    if 4 * experts + 6 != stats.shape[-1]:
        raise ValueError(f"routing statistics of width {stats.shape[-1]} are not 4 E + 6")
    c = experts + 1
    return RoutingStats(stats[..., :c], stats[..., c:2 * c], stats[..., 2 * c:3 * c], stats[..., 3 * c],
                        stats[..., 3 * c + 1], stats[..., 3 * c + 2:3 * c + 2 + experts], stats[..., -1])


__all__ = ["RoutingStats", "balancing_correction", "token_sums", "unpack", "SOLVE_ROUNDS", "SOLVE_TOKENS",
           "SOLVE_DAMPING", "CORRECTION_NAME"]

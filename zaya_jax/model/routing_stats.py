"""Per-layer routing statistics of a forward, in one flat fp32 vector per layer [4 E + 7] that adds across
data-parallel ranks with one psum (sums over the counted tokens, padding excluded):

    counts       [E+1]  tokens routed to each class (last = skip)
    prob_sum     [E+1]  sum of each class's softmax probability
    prob_sq_sum  [E+1]  sum of its square (with prob_sum: the token-to-token spread of the probabilities)
    top1_sum     []     sum of the largest probability (how confident the router is)
    entropy_sum  []     sum of the softmax entropy in nats (log(E+1) = uniform)
    moved_sum    []     tokens that model/equal_shares.py gave another expert than their balanced selection's
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

from zaya_jax.ops import balancing_solve


class RoutingStats(NamedTuple):
    counts: jax.Array
    prob_sum: jax.Array
    prob_sq_sum: jax.Array
    top1_sum: jax.Array
    entropy_sum: jax.Array
    moved_sum: jax.Array
    correction: jax.Array
    ranks: jax.Array

    @property
    def tokens(self):
        return self.counts.sum(-1)


# Jacobi rounds of the balancing solve, the share of each round's step taken, and the share of the previous round's
# change carried into the next (heavy-ball momentum). The solve starts from the biases that equalise the experts'
# median scores, which removes the shift common to all tokens (what collapses a router whose probabilities differ
# between tokens by less than one optimizer step moves them). It reads at most SOLVE_TOKENS tokens of the forward: a
# random subset (a regular stride aliases with periodic text such as indented code) whose positions move with the
# data, so that its sampling error, about 1 / sqrt(SOLVE_TOKENS / E) of each expert's share, differs between
# microbatches and layers instead of adding up over a step. Once the router has learned, many tokens sit in tight
# clusters of nearly equal scores shared by several experts, and plain rounds settle slowly there (16 left some
# forwards 1.5x off balance, 32 fewer); with the momentum, 24 rounds settle them better than 32 plain ones. Rounds
# are the solve's cost (each a sort of the margins in XLA, one launch with solve_impl 'pallas'). The measurements
# that chose these are in docs/routing.md.
SOLVE_ROUNDS = 24
SOLVE_TOKENS = 2048
SOLVE_DAMPING = 0.9
SOLVE_MOMENTUM = 0.4
SOLVE_START = "median"  # or 'zero': from the stored biases as they are (docs/routing.md: what chose the constants)
CORRECTION_NAME = "balancing_correction"  # its checkpoint_name: remat policies keep it (model/zaya.py)
SELECTION_NAME = "routed_experts"  # the train step's final expert per token (model/router.py), kept likewise


def balancing_correction(scores, valid, impl: str = "xla"):
    """scores [N, E] (each real expert's probability plus its balancing bias), valid [N] bool -> the zero-mean
    bias change delta [E] after which argmax(scores + delta) gives each expert about N/E of the valid tokens
    (estimated on at most SOLVE_TOKENS of them).

    Each round sets every expert's delta so that exactly N/E tokens prefer it to their best other expert (the
    midpoint of its N/E-th and next-largest margins), all experts at once, damped, with momentum; the margins are
    measured in the scores' own units, so the solve needs no step size whatever the spread of the probabilities.
    `impl` runs the rounds as XLA ops around a sort ('xla') or one Pallas launch per round ('pallas'); see
    ops/balancing_solve.py."""
    if scores.shape[0] > SOLVE_TOKENS:
        n = scores.shape[0]
        subset = np.random.default_rng(n).choice(n, SOLVE_TOKENS, replace=False).astype(np.uint32)
        # the data's low bits: a max, exact in any reduction order (another program must pick the same subset)
        shift = jax.lax.bitcast_convert_type(scores.max().astype(jnp.float32), jnp.uint32) % n
        subset = ((subset + shift) % n).astype(jnp.int32)
        scores, valid = scores[subset], valid[subset]
    num_experts = scores.shape[1]
    delta = balancing_solve.solve(scores.T, valid, rounds=SOLVE_ROUNDS, damping=SOLVE_DAMPING,
                                  momentum=SOLVE_MOMENTUM, impl=impl, start=SOLVE_START)
    count = valid.sum()
    return checkpoint_name(jnp.where(count >= num_experts, delta, 0.0), CORRECTION_NAME)


def token_sums(probs, index, correction, moved, token_mask=None) -> jax.Array:
    """probs [..., E+1] fp32, index [...], correction [E], moved [...] bool -> the flat statistics vector [4 E + 7]
    of these tokens."""
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
        (moved.astype(jnp.float32) * weight).sum(axes)[None],
        jax.lax.stop_gradient(correction).astype(jnp.float32),
        jnp.ones((1,), jnp.float32),
    ])


def unpack(stats) -> RoutingStats:
    """[..., 4 E + 7] -> RoutingStats of [..., E+1] / [..., E] / [...] arrays."""
    stats = jnp.asarray(stats, jnp.float32)
    experts = (stats.shape[-1] - 7) // 4
    if 4 * experts + 7 != stats.shape[-1]:
        raise ValueError(f"routing statistics of width {stats.shape[-1]} are not 4 E + 7")
    c = experts + 1
    return RoutingStats(stats[..., :c], stats[..., c:2 * c], stats[..., 2 * c:3 * c], stats[..., 3 * c],
                        stats[..., 3 * c + 1], stats[..., 3 * c + 2], stats[..., 3 * c + 3:3 * c + 3 + experts],
                        stats[..., -1])


__all__ = ["RoutingStats", "balancing_correction", "token_sums", "unpack", "SOLVE_ROUNDS", "SOLVE_TOKENS",
           "SOLVE_DAMPING", "SOLVE_MOMENTUM", "SOLVE_START", "CORRECTION_NAME", "SELECTION_NAME"]

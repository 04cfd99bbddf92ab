"""Equal expert shares for the training forward: after the balanced selection (the argmax of the scores plus the
solve's correction, model/router.py), every expert gets the same number of the forward's routed tokens (shares
that differ by at most one token).

Why: the solve sets one bias per expert from a subset of the tokens, which leaves a forward's busiest expert some
15-20% over an equal share at the bench preset. The grouped GEMMs pad every expert's rows to whole row tiles, so
uneven groups cost the step about as much as the solve does (docs/experiments.md); equal groups of a forward whose
token count E x the row tile divides fill whole tiles.

How (a greedy balanced assignment): an expert over its share keeps the tokens that prefer it most (the largest
margin of their score for it over their best other expert) and hands on the rest, padding tokens first. In each of
REFILL_ROUNDS rounds every handed-on token bids for its best expert with room, and each such expert takes the
bidders of the highest score for it; tokens left after the rounds fill the remaining room in token order. A token
of an expert at or under its share never moves, nor does a token routed to the skip class. Shares: floor(M / E) of
the M routed tokens, the remainder's extra tokens to the experts that hold the most. Ties break by token order.

Only the first N / BIDDER_FRACTION handed-on tokens (in token order) bid; any beyond them go to the fill. After the
solve a few percent of the tokens move, so the bids are ranked among that compacted set by counting its pairs (one
fused reduction) instead of by a sort of all N tokens: sorts of a few thousand elements are chains of small
launches on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.ops import group_quota
from zaya_jax.ops.balancing_solve import order_keys

REFILL_ROUNDS = 2
BIDDER_FRACTION = 4


def _ranks_by_counting(group, priority):
    """The ranks of ops/group_quota.ranks_within_groups for a small set (the bids, the experts): each element counts
    the elements of its group ahead of it (higher priority, or equal and earlier)."""
    i = jnp.arange(group.shape[0])
    other, me = priority[None, :], priority[:, None]
    ahead = (other > me) | ((other == me) & (i[None, :] < i[:, None]))
    return ((group[None, :] == group[:, None]) & ahead).sum(1, dtype=jnp.int32)


def _score_of(scores, expert):
    return jnp.take_along_axis(scores, jnp.minimum(expert, scores.shape[1] - 1)[:, None], axis=1)[:, 0]


def equal_shares(scores, index, valid, impl: str = "xla"):
    """scores [N, E] fp32: the expert scores the selection took its argmax of (probabilities + biases +
    correction); index [N] int32 in [0, E] (E: the skip class); valid [N] bool -> (index [N] with every expert at
    floor or ceil of M / E of the M routed tokens, moved [N] bool: the tokens given another expert). impl: how the
    over-full experts pick the tokens they keep (ops/group_quota.py)."""
    n, E = scores.shape
    routed = index < E
    expert = jnp.where(routed, index, E).astype(jnp.int32)
    counts = group_quota.sizes(expert, E)
    total = counts.sum()
    # each expert's place when ordered by count, most first, ties by id (the remainder's extra tokens go first)
    place_by_count = _ranks_by_counting(jnp.zeros(E, jnp.int32), counts)
    share = total // E + (place_by_count < total % E).astype(jnp.int32)

    own = _score_of(scores, expert)
    other = jnp.where(jax.nn.one_hot(expert, E, dtype=bool), -jnp.inf, scores).max(-1)
    margin = jnp.where(valid, own - other, -jnp.inf)
    moving = ~group_quota.kept(order_keys(margin), expert, share, impl)
    room = share - jnp.minimum(counts, share)

    # the bidders: the first `cap` handed-on tokens, gathered in token order (slot -> token; n marks an empty slot)
    cap = max(1, n // BIDDER_FRACTION)
    place = jnp.cumsum(moving, dtype=jnp.int32) - 1
    token = jnp.full(cap, n, jnp.int32).at[jnp.where(moving, place, cap)].set(jnp.arange(n, dtype=jnp.int32),
                                                                               mode="drop")
    bid_scores = scores[jnp.minimum(token, n - 1)]
    bid_valid = valid[jnp.minimum(token, n - 1)]
    won = jnp.full(cap, E, jnp.int32)  # the expert each slot's token won, E while none
    for _ in range(REFILL_ROUNDS):
        target = jnp.argmax(jnp.where(room > 0, bid_scores, -jnp.inf), axis=-1).astype(jnp.int32)
        bidding = (token < n) & (won == E)
        priority = order_keys(jnp.where(bid_valid, _score_of(bid_scores, target), -jnp.inf))
        wins = bidding & (_ranks_by_counting(jnp.where(bidding, target, E), priority) < room[target])
        won = jnp.where(wins, target, won)
        room = room - group_quota.sizes(jnp.where(wins, target, E), E)
    won_by_token = jnp.full(n, E, jnp.int32).at[token].set(won, mode="drop")
    new = jnp.where(won_by_token < E, won_by_token, expert)
    moving = moving & (won_by_token == E)
    # the k-th token left goes to the expert whose room, counted from expert 0, holds slot k
    slot = jnp.cumsum(moving) - 1
    fill = (jnp.cumsum(room)[None, :] <= slot[:, None]).sum(1).astype(jnp.int32)
    new = jnp.where(moving, fill, new)
    return jnp.where(routed, new, index).astype(index.dtype), routed & (new != expert)


__all__ = ["equal_shares", "REFILL_ROUNDS", "BIDDER_FRACTION"]

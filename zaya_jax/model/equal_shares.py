"""Equal expert shares for the training forward: after the balanced selection (the argmax of the scores plus the
solve's correction, model/router.py), every expert gets the same number of the forward's routed tokens (shares
that differ by at most one token).

Why: the solve sets one bias per expert from a subset of the tokens, which leaves a forward's busiest expert some
15-20% over an equal share at the bench preset. The grouped GEMMs pad every expert's rows to whole row tiles, so
uneven groups cost the step about as much as the solve does (docs/routing.md); equal groups of a forward whose
token count E x the row tile divides fill whole tiles.

How (a greedy balanced assignment): an expert over its share keeps the tokens that prefer it most (the largest
margin of their score for it over their best other expert) and hands on the rest, padding tokens first. In each of
REFILL_ROUNDS rounds every handed-on token bids for its best expert with room, and each such expert takes the
bidders of the highest score for it; tokens left after the rounds fill the remaining room in token order. A token
of an expert at or under its share never moves, nor does a token routed to the skip class. Shares: floor(M / E) of
the M routed tokens, the remainder's extra tokens to the experts that hold the most. Ties break by token order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.ops.balancing_solve import order_keys

REFILL_ROUNDS = 2


def _sizes(group, num_groups: int):
    """[num_groups] token counts of group [N] (values num_groups and above counted nowhere): a reduction, which XLA
    fuses, where a scatter-add would be a kernel of its own."""
    return jax.nn.one_hot(group, num_groups, dtype=jnp.int32).sum(0)


def _ranks_within_groups(group, priority, num_groups: int):
    """group [N] int32 in [0, num_groups], priority [N] int32 -> each token's rank within its group, highest
    priority first, ties in token order."""
    n = group.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    sorted_group, _, order = jax.lax.sort((group, ~priority, iota), num_keys=2, is_stable=True)  # ~p: descending
    sizes = _sizes(group, num_groups + 1)
    start = jnp.cumsum(sizes) - sizes
    return jnp.zeros(n, jnp.int32).at[order].set(iota - start[sorted_group])


def _score_of(scores, expert):
    return jnp.take_along_axis(scores, jnp.minimum(expert, scores.shape[1] - 1)[:, None], axis=1)[:, 0]


def equal_shares(scores, index, valid):
    """scores [N, E] fp32: the expert scores the selection took its argmax of (probabilities + biases +
    correction); index [N] int32 in [0, E] (E: the skip class); valid [N] bool -> (index [N] with every expert at
    floor or ceil of M / E of the M routed tokens, moved [N] bool: the tokens given another expert)."""
    n, E = scores.shape
    routed = index < E
    expert = jnp.where(routed, index, E).astype(jnp.int32)
    counts = _sizes(expert, E)
    total = counts.sum()
    # each expert's place when ordered by count, most first, ties by id (the remainder's extra tokens go first)
    ids = jnp.arange(E)
    ahead = (counts[None, :] > counts[:, None]) | ((counts[None, :] == counts[:, None]) & (ids[None, :] < ids[:, None]))
    share = total // E + (ahead.sum(1) < total % E).astype(jnp.int32)

    own = _score_of(scores, expert)
    other = jnp.where(jax.nn.one_hot(expert, E, dtype=bool), -jnp.inf, scores).max(-1)
    margin = jnp.where(valid, own - other, -jnp.inf)
    moving = routed & (_ranks_within_groups(expert, order_keys(margin), E) >= share[jnp.minimum(expert, E - 1)])
    room = share - jnp.minimum(counts, share)
    new = expert
    for _ in range(REFILL_ROUNDS):
        target = jnp.argmax(jnp.where(room > 0, scores, -jnp.inf), axis=-1).astype(jnp.int32)
        bid = jnp.where(moving, target, E)
        priority = order_keys(jnp.where(valid, _score_of(scores, target), -jnp.inf))
        won = moving & (_ranks_within_groups(bid, priority, E) < room[target])
        new = jnp.where(won, target, new)
        room = room - _sizes(jnp.where(won, target, E), E)
        moving = moving & ~won
    # the k-th token left goes to the expert whose room, counted from expert 0, holds slot k
    slot = jnp.cumsum(moving) - 1
    fill = (jnp.cumsum(room)[None, :] <= slot[:, None]).sum(1).astype(jnp.int32)
    new = jnp.where(moving, fill, new)
    return jnp.where(routed, new, index).astype(index.dtype), routed & (new != expert)


__all__ = ["equal_shares", "REFILL_ROUNDS"]

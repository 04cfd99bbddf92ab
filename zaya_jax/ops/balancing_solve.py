"""The balancing solve's rounds (model/routing_stats.py: balancing_correction) on an [E, N] block of expert scores.

From a start (the biases that equalise the experts' median valid scores, or the biases as they are), `rounds` Jacobi rounds each move every expert's
bias change to the midpoint of its k-th and (k+1)-th largest margin over each valid token's best other expert
(k = valid tokens // E, so that k tokens prefer it), damped, with heavy-ball momentum, the change kept zero-mean.

'xla' is the jnp reference below (a sort per round); 'pallas' runs each round as one launch
(pallas_kernels/balancing_solve.py: one program per expert, the order statistics by a search over counts). Both pick
the same order statistics, so they differ only by the rounding of the zero-mean shift.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def order_keys(x):
    """x fp32 -> int32 keys in the same order (a < b exactly when key(a) < key(b); -0 below +0). XLA:CPU sorts int32
    about 4x faster than fp32, whose total-order comparator it calls per comparison. The Pallas kernel searches the
    same keys (its own _key): the reference keeps its copy so that it neither imports Pallas nor shares the kernel's
    code."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _ascending_keys(x):
    """x [..., N] fp32 -> its order keys sorted ascending along the last axis (the float sort's order statistics)."""
    return jax.lax.sort(order_keys(x), dimension=x.ndim - 1, is_stable=False)


def _key_value(key):
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def median_start(scores, valid):
    """scores [E, N], valid [N] -> the change [E] that equalises the experts' median valid scores (an order
    statistic: exact whatever the reduction order, unlike a mean)."""
    count = valid.sum()
    lowest = _ascending_keys(jnp.where(valid, scores, jnp.inf))
    median = _key_value(jnp.take(lowest, jnp.maximum(count - 1, 0) // 2, axis=-1))
    return median.mean() - median


def rounds_reference(scores, valid, first, *, rounds: int, damping: float, momentum: float, min_rounds=None,
                     unsettled=None):
    """scores [E, N] fp32, valid [N] bool, first [E] (the change the rounds start from) -> the zero-mean bias change
    [E] (NaN-free only with >= 1 valid token). With `unsettled` (a traced test of the change), the rounds after the
    first `min_rounds` step only if it holds after them; otherwise they leave the change as it is."""
    num_experts, n = scores.shape
    k = jnp.clip(valid.sum() // num_experts, 1, n - 1)
    experts = jnp.arange(num_experts)[:, None]

    def round_(carry, stepping):
        delta, change = carry
        s = scores + delta[:, None]
        first = s.max(0, keepdims=True)
        is_first = experts == jnp.argmax(s, 0)[None]
        second = jnp.where(is_first, -jnp.inf, s).max(0, keepdims=True)
        margin = jnp.where(valid, s - jnp.where(is_first, second, first), -jnp.inf)
        ranked = _ascending_keys(margin)  # the k-th largest at n - k
        middle = 0.5 * (_key_value(jnp.take(ranked, n - k, axis=-1)) + _key_value(jnp.take(ranked, n - k - 1, axis=-1)))
        step = momentum * change - damping * jnp.where(jnp.isfinite(middle), middle, 0.0)
        step = step - step.mean()
        return (jnp.where(stepping, delta + step, delta), jnp.where(stepping, step, change)), None

    head = rounds if unsettled is None else min(min_rounds, rounds)
    carry, _ = jax.lax.scan(round_, (first, jnp.zeros_like(first)), jnp.ones(head, bool))
    if head < rounds:
        carry, _ = jax.lax.scan(round_, carry, jnp.full(rounds - head, unsettled(carry[0])))
    return carry[0]


def uneven(scores, valid, delta):
    """How far argmax(scores + delta) is from equal shares: the valid tokens over their expert's share (what equal
    shares would move), counted exactly (an integer, whatever the reduction order)."""
    num_experts = scores.shape[0]
    picked = jnp.argmax(scores + delta[:, None], 0)
    counts = jnp.sum((picked[None, :] == jnp.arange(num_experts)[:, None]) & valid[None, :], axis=1)
    return jnp.sum(jnp.maximum(counts - valid.sum() // num_experts, 0))


STARTS = ("median", "zero", "closer")


def solve(scores, valid, *, rounds: int, damping: float, momentum: float, impl: str = "xla", start: str = "median",
          min_rounds: int | None = None, settled: float = 0.0):
    """Up to `rounds` rounds from `start`: the change that equalises the experts' median scores ('median'), none
    ('zero': the scores' biases as they are), or whichever of the two leaves fewer tokens over their expert's share
    ('closer'). With `min_rounds`, the rounds after the first `min_rounds` run only if those leave more than
    `settled` of the valid tokens over their expert's share (a traced test: the skipped rounds still launch, idle)."""
    if start not in STARTS:
        raise ValueError(f"balancing solve: unknown start {start!r} (use one of {STARTS})")
    if impl == "xla":
        median, run = median_start, rounds_reference
    elif impl == "pallas":
        from pallas_kernels.balancing_solve import median_start as median, rounds as run
    else:
        raise ValueError(f"balancing solve: unknown impl {impl!r} (use 'xla' or 'pallas')")
    zero = jnp.zeros_like(scores[:, 0])  # zeros that vary like the scores inside shard_map
    first = zero if start == "zero" else median(scores, valid)
    if start == "closer":
        first = jnp.where(uneven(scores, valid, zero) < uneven(scores, valid, first), zero, first)
    unsettled = None
    if min_rounds is not None:
        unsettled = lambda delta: uneven(scores, valid, delta) > settled * valid.sum()  # noqa: E731
    return run(scores, valid, first, rounds=rounds, damping=damping, momentum=momentum, min_rounds=min_rounds,
               unsettled=unsettled)

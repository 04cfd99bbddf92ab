"""The balancing solve's rounds (model/routing_stats.py: balancing_correction) on an [E, N] block of expert scores.

From the biases that equalise the experts' median valid scores, `rounds` Jacobi rounds each move every expert's
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


def solve_reference(scores, valid, *, rounds: int, damping: float, momentum: float, start: str = "median"):
    """scores [E, N] fp32, valid [N] bool -> the zero-mean bias change [E] (NaN-free only with >= 1 valid token).
    start: the rounds start from the change that equalises the experts' median scores ('median') or from none
    ('zero': the scores' biases as they are)."""
    num_experts, n = scores.shape
    count = valid.sum()
    k = jnp.clip(count // num_experts, 1, n - 1)
    experts = jnp.arange(num_experts)[:, None]
    # each expert's median valid score (an order statistic: exact whatever the reduction order, unlike a mean)
    lowest = _ascending_keys(jnp.where(valid, scores, jnp.inf))
    median = _key_value(jnp.take(lowest, jnp.maximum(count - 1, 0) // 2, axis=-1))

    def round_(carry, _):
        delta, change = carry
        s = scores + delta[:, None]
        first = s.max(0, keepdims=True)
        is_first = experts == jnp.argmax(s, 0)[None]
        second = jnp.where(is_first, -jnp.inf, s).max(0, keepdims=True)
        margin = jnp.where(valid, s - jnp.where(is_first, second, first), -jnp.inf)
        ranked = _ascending_keys(margin)  # the k-th largest at n - k
        middle = 0.5 * (_key_value(jnp.take(ranked, n - k, axis=-1)) + _key_value(jnp.take(ranked, n - k - 1, axis=-1)))
        change = momentum * change - damping * jnp.where(jnp.isfinite(middle), middle, 0.0)
        change = change - change.mean()
        return (delta + change, change), None

    first = median.mean() - median if start == "median" else jnp.zeros_like(median)
    (delta, _), _ = jax.lax.scan(round_, (first, jnp.zeros_like(first)), None, length=rounds)
    return delta


def solve(scores, valid, *, rounds: int, damping: float, momentum: float, impl: str = "xla", start: str = "median"):
    if start not in ("median", "zero"):
        raise ValueError(f"balancing solve: unknown start {start!r} (use 'median' or 'zero')")
    if impl == "xla":
        return solve_reference(scores, valid, rounds=rounds, damping=damping, momentum=momentum, start=start)
    if impl == "pallas":
        from pallas_kernels.balancing_solve import solve as kernel
        return kernel(scores, valid, rounds=rounds, damping=damping, momentum=momentum, start=start)
    raise ValueError(f"balancing solve: unknown impl {impl!r} (use 'xla' or 'pallas')")

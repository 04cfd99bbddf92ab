"""The k-th and (k+1)-th largest element of each row, the two order statistics of every round of the balancing solve
(model/routing_stats.py), dispatched by `impl`.

'xla' sorts each row (the reference); 'pallas' counts, for every element, the elements of its row above it
(pallas_kernels/order_statistics.py) and takes masked minima. Both pick the same elements, ties included.
"""

from __future__ import annotations

import jax.numpy as jnp


def kth_and_next_largest(x, k, *, impl: str = "xla"):
    """x [R, N] float (no NaN), k int in [1, N - 1] (may be traced) -> (k-th largest, (k+1)-th largest), [R] each."""
    if impl == "xla":
        ranked = -jnp.sort(-x, axis=-1)
        return jnp.take(ranked, k - 1, axis=-1), jnp.take(ranked, k, axis=-1)
    if impl == "pallas":
        from pallas_kernels.order_statistics import rows_above
        above = rows_above(x)
        # the k-th largest is the smallest element with at most k - 1 elements above it
        return (jnp.min(jnp.where(above <= k - 1, x, jnp.inf), axis=-1),
                jnp.min(jnp.where(above <= k, x, jnp.inf), axis=-1))
    raise ValueError(f"kth_and_next_largest: unknown impl {impl!r} (use 'xla' or 'pallas')")

"""Which tokens each group keeps when it keeps only its quota of the highest keys, ties in token order (equal shares'
hand-on, model/equal_shares.py: an expert over its share keeps the tokens of the largest margin).

'xla' is the jnp reference: every token's rank within its group from a stable sort. 'pallas' finds each group's
cutoff key and last tie kept by a search over counts, one program per group (pallas_kernels/group_quota.py), and
compares: no sort of all N tokens, which is most of the reference's time on a GPU. Both keep the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sizes(group, num_groups: int):
    """[num_groups] token counts of group [N] (values num_groups and above counted nowhere): a reduction, which XLA
    fuses, where a scatter-add would be a kernel of its own."""
    return jax.nn.one_hot(group, num_groups, dtype=jnp.int32).sum(0)


def ranks_within_groups(group, priority, num_groups: int):
    """group [N] int32 in [0, num_groups], priority [N] int32 -> each token's rank within its group, highest
    priority first, ties in token order."""
    n = group.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    sorted_group, _, order = jax.lax.sort((group, ~priority, iota), num_keys=2, is_stable=True)  # ~p: descending
    counts = sizes(group, num_groups + 1)
    start = jnp.cumsum(counts) - counts
    return jnp.zeros(n, jnp.int32).at[order].set(iota - start[sorted_group])


def kept(keys, group, quota, impl: str = "xla"):
    """keys [N] int32, group [N] int32 in [0, G] (G: no group), quota [G] int32 -> [N] bool: the token is among its
    group's quota of highest keys, ties in token order (tokens of no group: True)."""
    num_groups = quota.shape[0]
    member = group < num_groups
    g = jnp.minimum(group, num_groups - 1)
    if impl == "xla":
        inside = ranks_within_groups(group, keys, num_groups) < quota[g]
    elif impl == "pallas":
        from pallas_kernels.group_quota import cutoffs
        cutoff, last = cutoffs(keys, jnp.where(member, group, -1), quota)
        position = jnp.arange(keys.shape[0], dtype=jnp.int32)
        inside = (keys > cutoff[g]) | ((keys == cutoff[g]) & (position <= last[g]))
    else:
        raise ValueError(f"group quota: unknown impl {impl!r} (use 'xla' or 'pallas')")
    return ~member | inside

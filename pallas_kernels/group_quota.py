"""Each group's cutoff when it keeps only its quota of the highest keys, ties in token order (the reference ranks
every token within its group by a sort: zaya_jax/ops/group_quota.py), as one Pallas launch (Triton lowering) of one
program per group.

A program reads every token's key and group, finds the quota-th largest key among its own tokens by the search over
counts that the balancing solve uses (_order_search.largest: Pallas-Triton has reductions but no sort), then, among
its tokens at that key, the last one kept in token order (a second search over their negated positions, which ends
at once unless more tokens tie at the cutoff than the quota leaves room for). A token is kept when its key is above
its group's cutoff, or at it and no later than the last tie kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _order_search as search
from pallas_kernels import platform
from pallas_kernels import vma

I32 = jnp.int32
CHUNK = 2048


def _cutoff_kernel(keys_ref, group_ref, quota_ref, cutoff_ref, last_ref):
    g = pl.program_id(0)
    n = keys_ref.shape[0]
    parts = [(start, pl.ds(start, min(CHUNK, n - start))) for start in range(0, n, CHUNK)]
    mine = [group_ref[part] == g for _, part in parts]
    # tokens of other groups read as -inf, below every key of this group's (its -inf keys, padding, are counted
    # through `mine` below)
    keys = [jnp.where(m, keys_ref[part], search.NEG_INF_KEY) for m, (_, part) in zip(mine, parts)]
    quota = jnp.sum(quota_ref[...])
    rank = jnp.maximum(quota, 1)
    # the rank-th largest key; -inf when fewer of this group's keys are finite
    cutoff, _ = search.largest(keys, rank)
    above = jnp.where(cutoff == search.INT_MAX, 0, search.count_at_or_above(keys, cutoff + 1))
    ties = [jnp.where(m & (k == cutoff), -(start + jnp.arange(k.shape[0], dtype=I32)), search.NEG_INF_KEY)
            for m, k, (start, _) in zip(mine, keys, parts)]
    # the (rank - above)-th earliest tie; when no more tie than that, the search returns -inf and every tie is kept
    last = -search.largest(ties, rank - above)[0]
    cutoff_ref[...] = jnp.full((1,), jnp.where(quota > 0, cutoff, search.INT_MAX), I32)
    last_ref[...] = jnp.full((1,), jnp.where(quota > 0, last, -1), I32)


def cutoffs(keys, group, quota):
    """keys [N] int32, group [N] int32 (values outside [0, G): no group), quota [G] int32 -> (cutoff [G] int32, last
    [G] int32): group g keeps its tokens of key > cutoff[g], and those of key == cutoff[g] at positions <= last[g]."""
    n, num_groups = keys.shape[0], quota.shape[0]
    pn, pg = pl.next_power_of_2(n), pl.next_power_of_2(num_groups)
    keys = jnp.pad(keys.astype(I32), (0, pn - n), constant_values=search.NEG_INF_KEY)
    group = jnp.pad(group.astype(I32), (0, pn - n), constant_values=-1)
    quota = jnp.pad(quota.astype(I32), (0, pg - num_groups))
    keys, group, quota = vma.vary_to_union(keys, group, quota)
    one = pl.BlockSpec((1,), lambda g: (g,))
    whole = pl.BlockSpec((pn,), lambda g: (0,))
    out = vma.out_struct((pg,), I32, keys)
    cutoff, last = pl.pallas_call(
        _cutoff_kernel, grid=(num_groups,), in_specs=(whole, whole, one), out_specs=(one, one), out_shape=(out, out),
        compiler_params=platform.compiler_params(search.warps(min(pn, CHUNK)), 1),
        interpret=platform.interpret())(keys, group, quota)
    return cutoff[:num_groups], last[:num_groups]

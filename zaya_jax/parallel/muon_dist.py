"""Distributed Muon under ZeRO-1: where Newton-Schulz runs when the optimizer state is sharded.

Newton-Schulz needs whole matrices, but the ZeRO-1 layout (sharding.zero1_spec) may cut a stack of matrices
[..., m, n] through its m or n dim. Two placements, both plugged in through `zaya_jax.optim.muon.orthogonalizer`:

* `whole_matrix` (ZeRO-1's default): whole-matrix ownership across the ZeRO group, written out in shard_map.
  A leaf whose layout already splits a stack dim (layers, experts) holds whole matrices: Newton-Schulz runs on
  them where they are, with no traffic. A leaf split through a matrix dim is padded with zero matrices to a
  multiple of the group and regrouped with one all_to_all so that each device owns 1/group of the matrices,
  whole; a second all_to_all returns the results to the ZeRO-1 layout. This is the JAX form of the paper's
  scheme (spec 12.4): no all-gather of the optimizer state for Newton-Schulz, only 1/group-sized exchanges.
* `all_gathered` (the baseline): every device all-gathers every Muon matrix, orthogonalises all of them and
  keeps its ZeRO-1 shard of the result.
Both return the ZeRO-1 layout, so the updated parameters are then all-gathered exactly as AdamW's are.

A zero padding matrix stays zero through Newton-Schulz (X / (||X|| + eps) = 0), so padding never makes NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def sharded_dim(spec: P) -> int | None:
    return next((i for i, s in enumerate(spec) if s is not None), None)


def whole_matrix(mesh, spec_of, axes: tuple[str, ...]):
    """Orthogonaliser: each device runs Newton-Schulz on the whole matrices it owns and returns the results in
    the ZeRO-1 layout; spec_of(shape) is a leaf's ZeRO-1 layout, axes the ZeRO group."""
    group = math.prod(mesh.shape[a] for a in axes)
    group_axes = axes[0] if len(axes) == 1 else axes

    def one(x, ns):
        spec = spec_of(x.shape)
        dim, lead = sharded_dim(spec), x.ndim - 2
        if dim is None:  # too small to shard: every device orthogonalises it (no traffic)
            return ns(x)
        if dim < lead:  # the layout splits a stack dim (layers, experts): whole matrices already, no traffic
            return jax.shard_map(ns, mesh=mesh, in_specs=spec, out_specs=spec)(x)

        def regrouped(local):  # the layout cuts every matrix: hand each device whole ones and back
            count, cut = math.prod(local.shape[:lead]), 1 + dim - lead
            mats = local.reshape(count, *local.shape[lead:])
            mats = jnp.pad(mats, ((0, -count % group), (0, 0), (0, 0)))
            whole = lax.all_to_all(mats, group_axes, split_axis=0, concat_axis=cut, tiled=True)
            back = lax.all_to_all(ns(whole), group_axes, split_axis=cut, concat_axis=0, tiled=True)
            return back[:count].reshape(local.shape)

        return jax.shard_map(regrouped, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    return lambda inputs, ns: [one(x, ns) for x in inputs]


def all_gathered(mesh, spec_of, axes: tuple[str, ...]):
    """Orthogonaliser of the baseline: gather every matrix, orthogonalise everywhere, keep the ZeRO-1 shard."""
    gather_axes = axes[0] if len(axes) == 1 else axes

    def one(x, ns):
        spec = spec_of(x.shape)
        dim = sharded_dim(spec)
        if dim is None:
            return ns(x)

        def body(local):
            full = ns(lax.all_gather(local, gather_axes, axis=dim, tiled=True))
            width = local.shape[dim]
            return lax.dynamic_slice_in_dim(full, lax.axis_index(gather_axes) * width, width, axis=dim)

        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    return lambda inputs, ns: [one(x, ns) for x in inputs]

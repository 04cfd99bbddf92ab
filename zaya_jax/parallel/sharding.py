"""Shardings of the train state: parameters replicated for compute, ZeRO-1 for the optimizer state.

ZeRO-1 (spec 13): every optimizer-state leaf (Muon momentum, Adam moments) is sharded over the ZeRO group, the
mesh axes that split the batch ('data', and 'context' when it is > 1), so each device keeps 1/group of it (the
train step's fp32 gradient sum over microbatches takes the gradients' reduce-scattered layout too). It is done
through GSPMD, and these are the collectives XLA emits (see tests/test_parallel_zero1.py, which reads them from
the compiled program):
  * gradients are constrained to the ZeRO-1 layout as they enter the optimizer, so the data-parallel
    reduction becomes a reduce-scatter (each device receives only its shard), not an all-reduce;
  * the update runs on the shards: AdamW elementwise, Muon's Newton-Schulz on whole matrices (muon_dist.py);
  * the train step's outputs keep the parameters replicated, so XLA all-gathers the updated parameters.
Parameters stay replicated fp32: they are the master copy, and the model casts to the compute dtype per op.
Gradient buckets: XLA fuses collectives up to its combiner thresholds, which `combine_threshold_options` sets
from the config (GPU backends; XLA's CPU backend does not combine these collectives).
"""

from __future__ import annotations

import math

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zaya_jax.optim.muon import orthogonalizer
from zaya_jax.parallel import muon_dist

MUON_PLACEMENTS = ("whole_matrix", "all_gathered")


def zero_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over (> 1 device); the optimizer state is sharded over all of them."""
    return tuple(a for a in ("data", "context") if a in mesh.axis_names and mesh.shape[a] > 1)


def zero1_spec(shape, axes: tuple[str, ...], size: int) -> P:
    """Shards the first dim divisible by the group size. Leading dims come first (stacked layers, experts), so
    whole matrices stay on one device where they can; a leaf with no such dim (a few small vectors) stays
    replicated."""
    if not axes:
        return P()
    for dim, n in enumerate(shape):
        if n % size == 0:
            return P(*([None] * dim), axes[0] if len(axes) == 1 else axes)
    return P()


def zero1_spec_fn(mesh):
    axes = zero_axes(mesh)
    size = math.prod(mesh.shape[a] for a in axes)
    return lambda shape: zero1_spec(shape, axes, size)


def state_shardings(state_shapes: dict, mesh, *, zero1: bool) -> dict:
    """NamedShardings for the train state {step, params, opt_state, model_state, balancer}: everything
    replicated except, with zero1, the optimizer state."""
    replicated = NamedSharding(mesh, P())
    shardings = jax.tree.map(lambda _: replicated, state_shapes)
    if zero1:
        spec_of = zero1_spec_fn(mesh)
        shardings["opt_state"] = jax.tree.map(lambda x: NamedSharding(mesh, spec_of(x.shape)),
                                              state_shapes["opt_state"])
    return shardings


def zero1(tx: optax.GradientTransformation, mesh, *, muon: str = "whole_matrix") -> optax.GradientTransformation:
    """tx with ZeRO-1 collectives: gradients reduce-scattered into the state's layout, Newton-Schulz on owned
    whole matrices (or, muon='all_gathered', the gather-everything baseline). The state structure is tx's own,
    so checkpoints do not depend on it. A no-op on a mesh with nothing to shard over."""
    if muon not in MUON_PLACEMENTS:
        raise ValueError(f"muon placement must be one of {MUON_PLACEMENTS}, got {muon!r}")
    axes = zero_axes(mesh)
    if not axes:
        return tx
    spec_of = zero1_spec_fn(mesh)
    if muon == "whole_matrix":
        place = muon_dist.whole_matrix(mesh, spec_of, axes)
    else:
        place = muon_dist.all_gathered(mesh, spec_of, axes)

    def update(grads, state, params=None, **extra):
        grads = jax.tree.map(lambda g: jax.lax.with_sharding_constraint(g, NamedSharding(mesh, spec_of(g.shape))),
                             grads)
        with orthogonalizer(place):
            return tx.update(grads, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def combine_threshold_options(bucket_bytes: int) -> dict:
    """XLA compiler options that set the gradient bucket size (collective combine thresholds); {} = defaults."""
    if not bucket_bytes:
        return {}
    return {f"xla_gpu_{kind}_combine_threshold_bytes": int(bucket_bytes)
            for kind in ("all_reduce", "reduce_scatter", "all_gather")}


def bytes_per_device(tree) -> tuple[int, int, int]:
    """(global bytes, bytes on one device, bytes of replicated leaves) of arrays or sharded ShapeDtypeStructs."""
    total = local = replicated = 0
    for x in jax.tree.leaves(tree):
        size = jax.numpy.dtype(x.dtype).itemsize
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(x.shape) * size
        local += math.prod(shard) * size
        if x.shape and tuple(shard) == tuple(x.shape):
            replicated += math.prod(x.shape) * size
    return total, local, replicated


def describe_optimizer_memory(opt_state, mesh) -> str:
    total, local, replicated = bytes_per_device(opt_state)
    axes = zero_axes(mesh)
    group = math.prod(mesh.shape[a] for a in axes)
    head = f"optimizer state: {total / 2**20:.2f} MiB in all, {local / 2**20:.2f} MiB on each device"
    if local == total:
        return head + " (replicated)"
    return (f"{head} (1/{total / max(local, 1):.2f}: ZeRO-1 over {axes}, {group} shards; "
            f"{replicated / 2**10:.1f} KiB in leaves too small to shard)")

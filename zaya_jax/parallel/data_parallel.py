"""Data (and context) parallel gradients computed per device in shard_map, reduced explicitly and hierarchically.

Left to GSPMD, the ZAYA step does not stay data parallel: for the sort-based MoE dispatch XLA all-gathers the
expert indices of every token of the global batch and all-reduces [all tokens, hidden] activations in every layer
(and with the ZeRO-1 layout it also all-gathers activations); tests/test_parallel_zero1.py checks that this path
moves nothing of the global batch's size. Here each device runs the model on its own rows (and, with
context parallelism, its zigzag share of their tokens), differentiates its own loss sum with respect to its own
copy of the replicated parameters, and the gradients are then reduced explicitly, inside the node first and then
across nodes on each rail (collectives.py):
  * into the ZeRO-1 layout with a reduce-scatter when the optimizer state is sharded, so each device receives
    only the shard its optimizer state covers;
  * with an all-reduce for replicated leaves.
The loss is the global token mean, as on one device: sum of token losses / number of counted tokens, both
summed over the mesh. The shard_map runs on `hierarchical_view(mesh)`: the same devices in the same order, with
'data' split into (node, data_local), so arrays laid out over 'data' pass in and out unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zaya_jax.model.layer_stack import is_layer_slices, stack_layer_slices
from zaya_jax.parallel.collectives import (
    LOCAL,
    NODE,
    hierarchical_psum,
    hierarchical_psum_scatter,
    hierarchical_view,
)
from zaya_jax.parallel.zigzag import Zigzag, to_layout

ALL = (NODE, LOCAL, "context")
INNER = (LOCAL, "context")  # the in-node axes the batch is split over


def _on_view(spec: P) -> P:
    """A spec over the trainer mesh's 'data' -> the same layout over (node, data_local)."""
    def entry(e):
        names = e if isinstance(e, tuple) else (e,)
        out = tuple(n for name in names for n in ((NODE, LOCAL) if name == "data" else (name,)))
        return out if len(out) > 1 else out[0]
    return P(*(None if e is None else entry(e) for e in spec))


def _reduce(g, spec: P):
    dim = next((i for i, s in enumerate(spec) if s is not None), None)
    if dim is None:
        return hierarchical_psum(g, INNER)
    split = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
    inner = tuple(a for a in INNER if a in split)
    # axes the layout does not split have size 1 (the ZeRO group is every batch axis > 1); summing over them
    # costs nothing and marks the gradient invariant over them, as its out_spec says
    rest = tuple(a for a in (NODE,) + INNER if a not in split)
    if rest:
        g = lax.psum(g, rest)
    if NODE not in split:  # data = 1 (pure context parallelism): one node, so the in-node step is the whole sum
        return lax.psum_scatter(g, inner, scatter_dimension=dim, tiled=True)
    return hierarchical_psum_scatter(g, inner, dim)


def sharded_value_and_grad(local_sums, mesh, grad_spec_of, *, zigzag: Zigzag | None = None,
                           nodes: int | None = None):
    """((loss, expert counts), grads) of the global token-mean loss.

    local_sums(params, model_state, local_batch) -> (sum of token losses, counted tokens, expert counts), run on
    each device's share of the batch ([B, S] fields split over data (and context), [B] fields over data);
    grad_spec_of(shape) -> PartitionSpec over the trainer mesh of a gradient leaf (the ZeRO-1 layout, or P());
    zigzag: lay the sequence axis out in zigzag order first (context parallelism); nodes: see hierarchical_view."""
    view = hierarchical_view(mesh, nodes)
    seq_spec, row_spec = P((NODE, LOCAL), "context"), P((NODE, LOCAL))

    def fn(params, model_state, batch):
        if zigzag is not None:
            batch = {k: to_layout(v, zigzag) if v.ndim == 2 else v for k, v in batch.items()}
        specs = {k: seq_spec if v.ndim == 2 else row_spec for k, v in batch.items()}
        # a per-layer view's leaves (LayerSlices) are reduced restacked, in the layout of the stacked parameter
        grad_specs = jax.tree.map(lambda p: _on_view(grad_spec_of(p.shape)), params, is_leaf=is_layer_slices)

        def body(params, model_state, batch):
            mine = jax.tree.map(lambda p: lax.pcast(p, ALL, to="varying"), params)  # its gradient stays local

            def local(p):
                total, counted, counts = local_sums(p, model_state, batch)
                return total, (counted, counts)

            (total, (counted, counts)), grads = jax.value_and_grad(local, has_aux=True)(mine)
            grads = stack_layer_slices(grads)
            counted = jnp.maximum(lax.psum(counted, ALL), 1.0)
            # fp32 before the reduction: leaves of a compute-dtype view (model/compute_view.py) come back in bf16
            grads = jax.tree.map(lambda g, s: _reduce(g.astype(jnp.promote_types(g.dtype, jnp.float32)) / counted,
                                                      s), grads, grad_specs)
            return (lax.psum(total, ALL) / counted, lax.psum(counts, ALL)), grads

        return jax.shard_map(body, mesh=view, in_specs=(P(), P(), specs),
                             out_specs=((P(), P()), grad_specs))(params, model_state, batch)

    return fn

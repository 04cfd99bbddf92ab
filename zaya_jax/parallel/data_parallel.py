"""Data (and context) parallel gradients computed per device in shard_map, reduced explicitly.

Left to GSPMD, the ZAYA step does not stay data parallel: the token gather of the embedding and the sort of the
MoE dispatch make XLA all-gather the whole batch's activations onto every device (tests/test_parallel_zero1.py
shows it from the compiled program). Here each device runs the model on its own rows (and, with context
parallelism, its zigzag share of their tokens), differentiates its own loss sum with respect to its own copy of
the replicated parameters, and the gradients are then reduced explicitly:
  * into the ZeRO-1 layout with a reduce-scatter (psum_scatter) when the optimizer state is sharded, so each
    device receives only the shard its optimizer state covers;
  * with an all-reduce (psum) for replicated leaves.
The loss is the global token mean, as on one device: sum of token losses / number of counted tokens, both
summed over the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.context import batch_specs
from zaya_jax.parallel.zigzag import Zigzag, to_layout

AXES = ("data", "context")


def _reduce(g, spec: P):
    dim = next((i for i, s in enumerate(spec) if s is not None), None)
    if dim is None:
        return lax.psum(g, AXES)
    scatter = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
    rest = tuple(a for a in AXES if a not in scatter)  # axes the layout does not split (size 1): a plain sum
    if rest:
        g = lax.psum(g, rest)
    return lax.psum_scatter(g, spec[dim], scatter_dimension=dim, tiled=True)


def sharded_value_and_grad(local_sums, mesh, grad_spec_of, *, zigzag: Zigzag | None = None):
    """((loss, expert counts), grads) of the global token-mean loss.

    local_sums(params, model_state, local_batch) -> (sum of token losses, counted tokens, expert counts), run on
    each device's share of the batch ([B, S] fields split over data (and context), [B] fields over data);
    grad_spec_of(shape) -> PartitionSpec of a gradient leaf (the ZeRO-1 layout, or P() for replicated);
    zigzag: lay the sequence axis out in zigzag order first (context parallelism)."""
    seq_spec, row_spec = batch_specs(mesh)

    def fn(params, model_state, batch):
        if zigzag is not None:
            batch = {k: to_layout(v, zigzag) if v.ndim == 2 else v for k, v in batch.items()}
        specs = {k: seq_spec if v.ndim == 2 else row_spec for k, v in batch.items()}
        grad_specs = jax.tree.map(lambda p: grad_spec_of(p.shape), params)

        def body(params, model_state, batch):
            mine = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)  # its gradient stays local

            def local(p):
                total, counted, counts = local_sums(p, model_state, batch)
                return total, (counted, counts)

            (total, (counted, counts)), grads = jax.value_and_grad(local, has_aux=True)(mine)
            counted = jnp.maximum(lax.psum(counted, AXES), 1.0)
            grads = jax.tree.map(lambda g, s: _reduce(g / counted, s), grads, grad_specs)
            return (lax.psum(total, AXES) / counted, lax.psum(counts, AXES)), grads

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), specs),
                             out_specs=((P(), P()), grad_specs))(params, model_state, batch)

    return fn

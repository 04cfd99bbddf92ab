"""Per-layer views of the stacked layer parameters for the unrolled model (scan_layers=False).

Indexing a stacked [L, ...] leaf once per layer makes its gradient the sum of L zero-padded slices (the transpose of
a slice is a pad). XLA merged those only partly: the bench step's backward spent a visible share of its time in
such adds ('add_any', docs/experiments.md). `unstack_layers` gives the slices a custom VJP that stacks the L
cotangents in one concatenation: the same values (the padded slices are disjoint, so the sum adds only zeros), in
one pass over the gradient. Both passes remain copies of every layer weight, a few percent of the
single-microbatch bench step's kernel time (docs/experiments.md); the accumulating step slices once per optimizer
step instead (`LayerSlices`, model/compute_view.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _unstack(x):
    return tuple(x[i] for i in range(x.shape[0]))


def _unstack_fwd(x):
    return _unstack(x), None


def _unstack_bwd(_, cotangents):
    return (jnp.stack(cotangents),)


_unstack.defvjp(_unstack_fwd, _unstack_bwd)


def unstack_layers(tree, n_layers: int) -> list:
    """tree of [n_layers, ...] leaves -> a list of n_layers trees of the per-layer slices (None leaves stay None).
    Inexact leaves go through the stacking VJP; integer ones (no gradient) are plainly indexed; LayerSlices (already
    sliced) give their slices, and their gradients stay per layer."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_layer_slices)
    for leaf in leaves:
        if leaf.shape[:1] != (n_layers,):
            raise ValueError(f"unstack_layers: every leaf needs a leading layer axis of {n_layers}, got {leaf.shape}")
    per_leaf = [x.slices if is_layer_slices(x) else _unstack(x) if jnp.issubdtype(x.dtype, jnp.inexact)
                else tuple(x[i] for i in range(n_layers)) for x in leaves]
    return [jax.tree.unflatten(treedef, [slices[i] for slices in per_leaf]) for i in range(n_layers)]


@jax.tree_util.register_pytree_node_class
class LayerSlices:
    """A stacked [L, ...] parameter held as its L per-layer arrays: what `unstack_layers` would slice, sliced once
    (model/compute_view.py does it once per optimizer step, outside the microbatch loop). Its gradient comes back as a
    LayerSlices of the per-layer gradients; `stack_layer_slices` restacks a tree of them."""

    def __init__(self, slices):
        self.slices = tuple(slices)

    def tree_flatten(self):
        return self.slices, None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.slices),) + tuple(self.slices[0].shape)

    @property
    def dtype(self):
        return self.slices[0].dtype


def is_layer_slices(x) -> bool:
    return isinstance(x, LayerSlices)


def holds_layer_slices(tree) -> bool:
    """Whether any leaf of tree is a LayerSlices (a per-layer view, model/compute_view.py)."""
    return any(map(is_layer_slices, jax.tree.leaves(tree, is_leaf=is_layer_slices)))


def stack_layer_slices(tree):
    """tree with every LayerSlices replaced by its stacked [L, ...] array."""
    return jax.tree.map(lambda x: jnp.stack(x.slices) if is_layer_slices(x) else x, tree, is_leaf=is_layer_slices)

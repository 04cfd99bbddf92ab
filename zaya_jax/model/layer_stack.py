"""Per-layer views of the stacked layer parameters for the unrolled model (scan_layers=False).

Indexing a stacked [L, ...] leaf once per layer makes its gradient the sum of L zero-padded slices (the transpose of
a slice is a pad). XLA merged those only partly: the bench step's backward spent 4.7 ms in such adds
(benchmarks/train_h200_profile.json, 'add_any'). `unstack_layers` gives the slices a custom VJP that stacks the L
cotangents in one concatenation: the same values (the padded slices are disjoint, so the sum adds only zeros), in
one pass over the gradient.
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
    Inexact leaves go through the stacking VJP; integer ones (no gradient) are plainly indexed."""
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        if leaf.shape[:1] != (n_layers,):
            raise ValueError(f"unstack_layers: every leaf needs a leading layer axis of {n_layers}, got {leaf.shape}")
    per_leaf = [_unstack(x) if jnp.issubdtype(x.dtype, jnp.inexact) else tuple(x[i] for i in range(n_layers))
                for x in leaves]
    return [jax.tree.unflatten(treedef, [slices[i] for slices in per_leaf]) for i in range(n_layers)]

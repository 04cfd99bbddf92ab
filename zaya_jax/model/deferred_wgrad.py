"""Expert weight gradients deferred to the end of an accumulation pass (the accumulating train step's option).

With k microbatches per pass, the usual way writes each microbatch's expert gradients in the compute dtype (97% of
the layer parameters at ZAYA1 widths), then one fp32 pass reads all k and adds them to the sum. Deferred instead:
each microbatch's backward leaves the expert weights' gradients out and hands over what they need (each layer's
input rows, output gradient and tile layout: ops/grouped_matmul.DeferredWgrad), and after the pass one kernel per
weight adds all k microbatches' gradients to the fp32 sum in place (`grouped_wgrad_sum`). Same sum with one rounding
less (no per-microbatch rounding to the compute dtype); the pass holds those activations instead of k gradients.
On the H200 the deferred sum is faster per layer and pass for both gate_up and down, and the bench step with 16
microbatches slightly faster (docs/experiments.md).
"""

from __future__ import annotations

import jax

from zaya_jax.model.compute_view import LAYERS, key_path
from zaya_jax.model.layer_stack import LayerSlices, is_layer_slices
from zaya_jax.ops import grouped_matmul as gmm

EXPERT_LEAVES = tuple(LAYERS + ("mlp", "experts", name) for name in ("gate_up_proj", "down_proj"))


def _is_expert_leaf(path) -> bool:
    return key_path(path) in EXPERT_LEAVES


def defer_expert_wgrads(view, num_tokens: int, block_rows: int):
    """The per-layer view (compute_view(per_layer=True): expert leaves are LayerSlices in the compute dtype) with
    each layer's expert weights wrapped with the zero taps of a num_tokens-token microbatch."""
    def wrap(path, leaf):
        if not _is_expert_leaf(path):
            return leaf
        if not is_layer_slices(leaf):
            raise ValueError("deferred expert gradients need the per-layer view (unrolled layers, per_layer_view)")
        return LayerSlices(gmm.defer_wgrad(w, num_tokens, block_rows) for w in leaf.slices)
    return jax.tree_util.tree_map_with_path(wrap, view, is_leaf=is_layer_slices)


def accumulate(total, group_grads, add, *, impl: str):
    """total (fp32, the plain view's structure) plus the gradients of a pass's microbatches: add(total_leaf, *leaves)
    for every leaf but the deferred expert weights, whose gradients are formed here from the taps' cotangents."""
    def leaf(path, t, *gs):
        if not _is_expert_leaf(path):
            return jax.tree.map(add, t, *gs)
        return LayerSlices(
            gmm.grouped_wgrad_sum(t_l, [g.slices[layer].dy for g in gs], [g.slices[layer].x for g in gs],
                                  [g.slices[layer].tiles for g in gs], impl=impl)
            for layer, t_l in enumerate(t.slices))
    return jax.tree_util.tree_map_with_path(leaf, total, *group_grads, is_leaf=is_layer_slices)

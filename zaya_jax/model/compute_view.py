"""The parameters the model only ever reads in the compute dtype, cast once per optimizer step.

Matmul weights of the layers (experts: 97% of the layer parameters at ZAYA1 widths; attention projections) enter
every use as `weight.astype(compute dtype)`. Over k accumulated microbatches that cast is loop-invariant work done k
times: one pass over the fp32 master weights per microbatch. `compute_view` casts them once; differentiating the
loss at the view gives their gradients in the compute dtype, the very values the cast's transpose would have
upcast, so accumulating them in fp32 is numerically the same as differentiating at the fp32 parameters.

Leaves outside this list (norm weights, router, biases, the embedding table, which the lookup reads in fp32) keep
their dtype. tests/test_compute_view.py pins the equality of losses and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.model.layer_stack import LayerSlices

# Paths in the parameter tree (ZayaForCausalLM's nnx.to_pure_dict) of leaves read only through a cast to the
# compute dtype. Linear biases are excluded: they are added in fp32.
LAYERS = ("model", "layers")  # the stacked [L, ...] layer parameters
COMPUTE_DTYPE_LEAVES = tuple(LAYERS + p for p in (
    ("mlp", "experts", "gate_up_proj"),
    ("mlp", "experts", "down_proj"),
    ("self_attn", "qkv_proj", "q_proj", "weight"),
    ("self_attn", "qkv_proj", "k_proj", "weight"),
    ("self_attn", "qkv_proj", "v_proj_current", "weight"),
    ("self_attn", "qkv_proj", "v_proj_delayed", "weight"),
    ("self_attn", "qkv_proj", "conv_qk_grouped", "weight"),
    ("self_attn", "o_proj", "weight"),
))


ROUTER = LAYERS + ("mlp", "gate")  # the routers' parameters, which model/router.py reads in fp32


def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def key_path(path) -> tuple[str, ...]:
    """A jax key path of the parameter tree as its tuple of names (the form of COMPUTE_DTYPE_LEAVES)."""
    return tuple(_key(e) for e in path)


def tree_get(tree, path):
    """tree[path[0]][path[1]]... of a nested dict."""
    for key in path:
        tree = tree[key]
    return tree


def tree_replace(tree, path, value):
    """A copy of the nested dict `tree` with the entry at `path` set to value (the dicts along the path copied,
    nothing else)."""
    if not path:
        return value
    return {**tree, path[0]: tree_replace(tree[path[0]], path[1:], value)}


def compute_view(params, compute_dtype=None, *, per_layer: bool = False):
    """params with the COMPUTE_DTYPE_LEAVES cast to compute_dtype (None: no cast; others unchanged). per_layer (the
    unrolled model, scan_layers=False): also hold every stacked layer leaf as its per-layer arrays (LayerSlices),
    sliced here once instead of in every microbatch's forward, with per-layer gradients (no restacking pass in every
    backward). A no-op tree when nothing is cast and per_layer is off."""
    dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
    wanted = set(COMPUTE_DTYPE_LEAVES)

    def view(path, leaf):
        keys = key_path(path)
        cast = dtype is not None and keys in wanted and jnp.issubdtype(leaf.dtype, jnp.floating)
        if per_layer and keys[:2] == LAYERS and jnp.issubdtype(leaf.dtype, jnp.inexact):
            return LayerSlices(leaf[i].astype(dtype) if cast else leaf[i] for i in range(leaf.shape[0]))
        return leaf.astype(dtype) if cast else leaf

    return jax.tree_util.tree_map_with_path(view, params)


def inference_view(params):
    """The per-layer view that the inference programs read (compute_view per_layer), with the routers' floating
    parameters in fp32: the router computes in fp32, so a bf16 model's router weights would be cast at every call,
    and in a decode loop at every token (XLA hoists no size-inflating op out of a loop). The values are those of the
    per-call casts."""
    def fp32_router(path, leaf):
        routed = key_path(path)[:len(ROUTER)] == ROUTER and jnp.issubdtype(leaf.dtype, jnp.floating)
        return leaf.astype(jnp.float32) if routed else leaf

    return compute_view(jax.tree_util.tree_map_with_path(fp32_router, params), per_layer=True)

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

# Paths in the parameter tree (ZayaForCausalLM's nnx.to_pure_dict) of leaves read only through a cast to the
# compute dtype. Linear biases are excluded: they are added in fp32.
COMPUTE_DTYPE_LEAVES = tuple(("model", "layers") + p for p in (
    ("mlp", "experts", "gate_up_proj"),
    ("mlp", "experts", "down_proj"),
    ("self_attn", "qkv_proj", "q_proj", "weight"),
    ("self_attn", "qkv_proj", "k_proj", "weight"),
    ("self_attn", "qkv_proj", "v_proj_current", "weight"),
    ("self_attn", "qkv_proj", "v_proj_delayed", "weight"),
    ("self_attn", "qkv_proj", "conv_qk_grouped", "weight"),
    ("self_attn", "o_proj", "weight"),
))


def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def compute_view(params, compute_dtype):
    """params with the COMPUTE_DTYPE_LEAVES cast to compute_dtype (others unchanged). A no-op tree when the
    compute dtype is the parameters' own."""
    dtype = jnp.dtype(compute_dtype)
    wanted = set(COMPUTE_DTYPE_LEAVES)

    def cast(path, leaf):
        if tuple(_key(e) for e in path) in wanted and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, params)

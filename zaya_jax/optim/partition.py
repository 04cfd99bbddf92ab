"""Which parameter goes to which optimizer, and which is weight-decayed, decided by its path.

Paths are the Hugging Face key names joined by '/', e.g. 'model/layers/self_attn/qkv_proj/q_proj/weight' (nnx's
trailing '.value' dropped). Rules match the end of a path, so they hold for the full model, a single layer, or a
bare MoE block alike.

Muon (spec 12.2 [PROPOSAL]): q/k/v/o projections, each expert's gate_up and down matrix, router down_proj, fc1,
fc2. AdamW: everything else (embedding / tied head, norms, biases, residual and input scales, router_states_scale,
qk_norm temp, both conv kernels and their biases, router out_proj). Weight decay: every Muon matrix, and the
embedding, untied head and router out_proj among the AdamW parameters; never vectors, scales, temps or biases.
"""

from __future__ import annotations

import re

import jax

MUON, ADAMW = "muon", "adamw"

MUON_PATTERNS = (
    r"(^|/)(q_proj|k_proj|v_proj_current|v_proj_delayed|o_proj)/weight$",
    r"(^|/)experts/(gate_up_proj|down_proj)$",
    r"(^|/)gate/down_proj/weight$",
    r"(^|/)router_mlp/(fc1|fc2)/weight$",
)
DECAYED_ADAMW_PATTERNS = (
    r"(^|/)embed_tokens/weight$",
    r"(^|/)lm_head/weight$",
    r"(^|/)router_mlp/out_proj/weight$",
)


def key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_path(keypath) -> str:
    """A jax key path -> 'model/layers/mlp/experts/gate_up_proj' (nnx Variable '.value' dropped)."""
    names = [key_name(k) for k in keypath]
    if names and names[-1] == "value":
        names = names[:-1]
    return "/".join(names)


def _matches(path: str, patterns) -> bool:
    return any(re.search(p, path) for p in patterns)


def group_of(path: str, muon_patterns=MUON_PATTERNS) -> str:
    return MUON if _matches(path, muon_patterns) else ADAMW


def is_decayed(path: str, muon_patterns=MUON_PATTERNS, decayed_adamw_patterns=DECAYED_ADAMW_PATTERNS) -> bool:
    return _matches(path, muon_patterns) or _matches(path, decayed_adamw_patterns)


def label_params(params, muon_patterns=MUON_PATTERNS):
    """Tree of 'muon' / 'adamw' labels with the structure of params (for optax.partition)."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: group_of(param_path(kp), muon_patterns), params)


def decay_mask(params, muon_patterns=MUON_PATTERNS, decayed_adamw_patterns=DECAYED_ADAMW_PATTERNS):
    """Tree of bools: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: is_decayed(param_path(kp), muon_patterns, decayed_adamw_patterns), params)


def check_muon_shapes(params, muon_patterns=MUON_PATTERNS):
    """Every Muon parameter must be a matrix or a stack of matrices (leading dims = layers, experts)."""
    for kp, p in jax.tree_util.tree_leaves_with_path(params):
        path = param_path(kp)
        if group_of(path, muon_patterns) == MUON and len(p.shape) < 2:
            raise ValueError(f"{path} matches a Muon rule but has shape {p.shape}; Muon needs matrices")


__all__ = ["MUON", "ADAMW", "MUON_PATTERNS", "DECAYED_ADAMW_PATTERNS", "param_path", "group_of", "is_decayed",
           "label_params", "decay_mask", "check_muon_shapes"]

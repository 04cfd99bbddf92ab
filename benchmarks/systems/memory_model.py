"""Per-device memory of a training step: parameters, gradients and optimizer state (with ZeRO-1 sharding and
TP/EP splits) plus activations (itemized per token and layer, with the remat policy and attention kernel),
the logits, and a reserve for the runtime.

Two recipes:
  paper     Megatron-style as the ZAYA1 run (spec section 13): bf16 weights, fp32 gradient buffer, fp32 master
            weights and optimizer state sharded over data parallel (ZeRO-1), no recomputation, fused kernels
            (norm, SwiGLU, attention) that keep one input per op. An assumption about their stack; it reproduces
            the paper's "microbatch 5 fits at 4k" and "CP 2 with microbatch 1 at 32k" on MI300X.
  zaya_jax  this trainer today (train/loop.py): fp32 parameters and gradients, optimizer state replicated, the
            model config's remat policy and attention implementation ('xla' materializes the fp32 scores), the
            unfused reference ops' residuals (about twice the fused inventory per layer), the bf16 weight copies
            the backward reuses, and optax's full update tree. Checked against jax's saved residuals and XLA's
            compiled allocation (memory_check.py, tests/test_systems_sizing.py and _breakdown.py).
Muon keeps one fp32 momentum per matrix, AdamW two fp32 moments (optim/partition.py decides which is which).
"""

from __future__ import annotations

import dataclasses

from zaya_jax.config import ModelConfig

F32 = 4


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    weight_bytes: int
    grad_bytes: int
    master_bytes: int  # fp32 copy kept by the optimizer when weights are low precision (0: none)
    zero1: bool  # master and optimizer state sharded over the data-parallel (x context-parallel) group
    remat: str  # 'none' | 'full' | 'save_attention' ('save_dots' is costed as 'none', an upper bound)
    fused_attention: bool  # False: the attention probabilities [T] per head and query are stored
    layer_inventory: str = "fused"  # 'fused' (fused norm / SwiGLU / attention kernels) | 'zaya_jax' (model/ today)
    compute_weight_copy: bool = False  # weights cast to the compute dtype are kept for the backward's matmuls
    update_bytes: int = 0  # the whole update tree, alive next to the gradients before it is applied (optax)
    activation_bytes: int = 2  # compute dtype
    muon_state_bytes: int = 4
    adam_state_bytes: int = 8


PAPER = Recipe("paper", weight_bytes=2, grad_bytes=4, master_bytes=4, zero1=True, remat="none",
               fused_attention=True)


def zaya_jax_recipe(cfg: ModelConfig) -> Recipe:
    weight_bytes = 4 if cfg.param_dtype == "float32" else 2
    activation = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.dtype]
    return Recipe("zaya_jax", weight_bytes=weight_bytes, grad_bytes=4, master_bytes=0, zero1=False, remat=cfg.remat,
                  fused_attention=cfg.attention_impl != "xla", layer_inventory="zaya_jax",
                  compute_weight_copy=activation != weight_bytes, update_bytes=4, activation_bytes=activation)


@dataclasses.dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel ranks
    tp: int = 1
    ep: int = 1
    cp: int = 1


# ---- parameters ---------------------------------------------------------------------------------------------------
def param_groups(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by how they shard and which optimizer holds them: embedding (+ untied head), attention
    matrices, expert matrices, router Muon matrices, and the small rest (vectors, convs, router out_proj)."""
    D, L, E, I, R = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.moe_intermediate_size, \
        cfg.router_hidden_size
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    counts = cfg.param_counts()
    embedding = counts["embedding"]
    attention = L * (D * H * d + D * KV * d + 2 * D * (KV * d // 2) + H * d * D)
    experts = L * E * 3 * I * D
    router = L * (R * D + 2 * R * R)
    rest = counts["total"] - embedding - attention - experts - router
    return dict(embedding=embedding, attention=attention, experts=experts, router=router, rest=rest)


def muon_params(cfg: ModelConfig) -> int:
    g = param_groups(cfg)
    return g["attention"] + g["experts"] + g["router"]


def params_per_device(cfg: ModelConfig, par: Parallel) -> dict[str, float]:
    """Muon and AdamW parameters held by one device: TP splits the embedding and attention matrices, EP x TP the
    experts."""
    g = param_groups(cfg)
    muon = g["attention"] / par.tp + g["experts"] / (par.ep * par.tp) + g["router"]
    adam = g["embedding"] / par.tp + g["rest"]
    return dict(muon=muon, adam=adam)


def static_bytes(cfg: ModelConfig, recipe: Recipe, par: Parallel) -> dict[str, float]:
    p = params_per_device(cfg, par)
    total = p["muon"] + p["adam"]
    shards = par.dp * par.cp if recipe.zero1 else 1
    state = (p["muon"] * (recipe.master_bytes + recipe.muon_state_bytes)
             + p["adam"] * (recipe.master_bytes + recipe.adam_state_bytes))
    out = dict(weights=total * recipe.weight_bytes, grads=total * recipe.grad_bytes, optimizer=state / shards)
    if recipe.update_bytes:
        out["updates"] = total * recipe.update_bytes
    if recipe.compute_weight_copy:
        # the cast layer weights live from the forward to the backward (all layers without remat; with remat the
        # casts are redone per layer, and only the embedding / head copy stays)
        layers = total - params_per_device_embedding(cfg, par)
        kept = total if recipe.remat in ("none", "save_dots") else total - layers
        out["compute_weight_copies"] = kept * recipe.activation_bytes
    return out


def params_per_device_embedding(cfg: ModelConfig, par: Parallel) -> float:
    return param_groups(cfg)["embedding"] / par.tp


# ---- activations ----------------------------------------------------------------------------------------------
def layer_activation_items(cfg: ModelConfig, recipe: Recipe, seq_len: int, tp: int = 1) -> dict[str, float]:
    """Bytes per token kept for the backward of one decoder layer when nothing is recomputed."""
    items = (_fused_layer if recipe.layer_inventory == "fused" else _zaya_jax_layer)(cfg, recipe.activation_bytes, tp)
    if not recipe.fused_attention:  # per head and key: mask, masked scores, exp, normalized (fp32), probabilities
        H = cfg.num_attention_heads / tp
        items["attention_probabilities"] = (1 + 3 * F32 + recipe.activation_bytes) * H * seq_len
    return items


def _widths(cfg: ModelConfig, tp: int):
    return (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim / tp, cfg.num_key_value_heads * cfg.head_dim / tp,
            cfg.conv_channels / tp, cfg.moe_intermediate_size / tp, cfg.router_hidden_size, cfg.num_experts)


def _fused_layer(cfg: ModelConfig, a: int, tp: int) -> dict[str, float]:
    """A stack with fused norm, SwiGLU and attention kernels (Megatron-style, the paper's): each op keeps its
    input once, in the compute dtype unless the op runs in fp32 (residual stream, router)."""
    D, q, kv, C, I, R, E = _widths(cfg, tp)
    return dict(residual_in=F32 * D, input_norm=a * D, qk_projections=a * (q + kv), convolutions=a * 2 * C,
                qk_mean_paths=a * (q + kv), values=a * 1.5 * kv, qk_norm_and_rope=a * 2 * (q + kv),
                attention_out=a * q + F32 * cfg.num_attention_heads / tp, o_projection=a * D,
                post_attention_residual_and_norm=F32 * D + a * D, router=F32 * (7 * R + 2 * (E + 1)),
                experts=a * (3 * D + 3 * I), post_mlp_residual=F32 * D)


def _zaya_jax_layer(cfg: ModelConfig, a: int, tp: int) -> dict[str, float]:
    """What jax saves for model/ as written (unfused reference ops; counted from print_saved_residuals): the
    fp32 residual merges keep their inputs and products, the convolutions and QK-norm run in fp32, the router's
    exact GELUs keep their intermediates, the SwiGLU keeps gate, up and both activations."""
    D, q, kv, C, I, R, E = _widths(cfg, tp)
    return dict(input_norm=F32 * D + a * D, convolutions=4 * F32 * C + 2 * a * C, values=a * kv,
                qk_norm=2 * F32 * (q + kv), rope=a * (q + kv),
                attention_in_out=2 * a * q + 2 * F32 * cfg.num_attention_heads / tp,
                post_attention_merge_and_norm=5 * F32 * D, router=F32 * (11 * R + E + 1),
                experts=a * (3 * D + 6 * I) + D, post_mlp_merge=3 * F32 * D)


def activation_bytes(cfg: ModelConfig, recipe: Recipe, seq_len: int, tokens: float, tp: int = 1) -> dict[str, float]:
    """Activation memory of `tokens` tokens on one device (a microbatch's share), by part."""
    per_layer = sum(layer_activation_items(cfg, recipe, seq_len, tp).values())
    D, R, L = cfg.hidden_size, cfg.router_hidden_size, cfg.num_hidden_layers
    if recipe.remat in ("none", "save_dots"):
        kept = L * per_layer
    else:  # each layer keeps its inputs (residual + router state); one layer is rebuilt at a time in the backward
        kept = L * F32 * (D + R) + per_layer
        if recipe.remat == "save_attention":
            kept += L * recipe.activation_bytes * cfg.num_attention_heads * cfg.head_dim / tp
    return dict(layers=kept * tokens, backward_workspace=per_layer * tokens,
                logits=2 * F32 * cfg.vocab_size / tp * tokens, embedding=F32 * D * tokens)


# ---- total ----------------------------------------------------------------------------------------------------
def step_memory(cfg: ModelConfig, recipe: Recipe, par: Parallel, seq_len: int, microbatch: int,
                hbm_bytes: float | None = None, reserved_fraction: float = 0.0) -> dict[str, float]:
    """Bytes by part for `microbatch` sequences of `seq_len` per data-parallel rank (a sequence is split over the
    cp ranks of its context-parallel group)."""
    tokens = microbatch * seq_len / par.cp
    out = {**static_bytes(cfg, recipe, par), **activation_bytes(cfg, recipe, seq_len, tokens, par.tp)}
    if hbm_bytes:
        out["reserved"] = reserved_fraction * hbm_bytes
    out["total"] = sum(out.values())
    return out


def largest_microbatch(cfg: ModelConfig, recipe: Recipe, par: Parallel, seq_len: int, hbm_bytes: float,
                       reserved_fraction: float, limit: int = 1024) -> int:
    """Largest microbatch (sequences per data-parallel rank) whose step fits in HBM; 0 if not even one."""
    best = 0
    for mb in range(1, limit + 1):
        if step_memory(cfg, recipe, par, seq_len, mb, hbm_bytes, reserved_fraction)["total"] > hbm_bytes:
            break
        best = mb
    return best

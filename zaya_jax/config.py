"""ModelConfig: the ZAYA1 architecture hyper-parameters, presets and validation.

Field names follow the Hugging Face `ZayaConfig` so config.json round-trips; every field that changes the
math is honoured by the model (see `zaya_jax/model`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

_HF_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
_LAYER_TYPES = ("hybrid", "hybrid_sliding")


# the kernel choices of each *_impl field and of remat
IMPLS = {"attention_impl": ("xla", "pallas", "cudnn"), "norm_impl": ("xla", "pallas"), "ce_impl": ("xla", "pallas"),
         "conv_impl": ("xla", "pallas"), "solve_impl": ("xla", "pallas"),
         "moe_impl": ("ragged", "pallas", "dense", "decode"), "remat": ("none", "full", "save_dots", "save_attention")}


class ConfigError(ValueError):
    """A model configuration value that the ZAYA architecture cannot take."""


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # ModelConfig.dtype
PARAM_DTYPES = ("float32", "bfloat16")  # ModelConfig.param_dtype


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    partial_rotary_factor: float = 0.5


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 262272
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    moe_intermediate_size: int = 2048
    num_experts: int = 16
    num_experts_per_tok: int = 1
    router_hidden_size: int = 256
    cca_time0: int = 2
    cca_time1: int = 2
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    lm_head_bias: bool = False
    tie_word_embeddings: bool = True
    # RoPE per layer type ("hybrid" = full causal attention, "hybrid_sliding" = sliding window).
    rope: dict[str, RopeConfig] = dataclasses.field(
        default_factory=lambda: {"hybrid": RopeConfig(5_000_000.0), "hybrid_sliding": RopeConfig(10_000.0)}
    )
    layer_types: tuple[str, ...] | None = None  # None = all "hybrid"
    sliding_window: int | None = None
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 106

    # Not HF fields: how we compute, never what we compute.
    dtype: str = "bfloat16"  # compute dtype; params, residual stream, router, norms stats and logits stay fp32
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # 'xla' | 'pallas' | 'cudnn'  (see zaya_jax/ops/attention.py)
    norm_impl: str = "xla"  # 'xla' | 'pallas'
    ce_impl: str = "xla"  # 'xla' | 'pallas': softmax cross-entropy of the chunked head loss (ops/cross_entropy.py)
    conv_impl: str = "xla"  # 'xla' | 'pallas': CCA's q/k mixing, both convolutions + mean residuals (ops/cca_conv.py)
    moe_impl: str = "ragged"  # 'ragged' (sort + lax.ragged_dot) | 'pallas' (tile-padded grouped GEMM kernels)
    #                           | 'dense' (reference: every expert on every token) | 'decode' (few tokens, experts.py)
    solve_impl: str = "xla"  # 'xla' | 'pallas': the train step's balancing solve and equal shares' hand-on
    #                         (ops/balancing_solve.py, ops/group_quota.py)
    remat: str = "full"  # 'none' | 'full' | 'save_dots' | 'save_attention'  (activation checkpoint policy)
    scan_layers: bool = True

    def __post_init__(self):
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", ("hybrid",) * self.num_hidden_layers)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "rope", {k: (v if isinstance(v, RopeConfig) else RopeConfig(**v))
                                          for k, v in self.rope.items()})
        self.validate()

    # ----------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "moe_intermediate_size", "num_experts", "router_hidden_size", "cca_time0",
                     "cca_time1"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
             f"({self.num_key_value_heads})")
        need(self.num_experts_per_tok == 1,
             f"num_experts_per_tok must be 1 (ZAYA1 routes top-1), got {self.num_experts_per_tok}")
        need(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        need(self.hidden_act in _HF_ACTIVATIONS, f"hidden_act {self.hidden_act!r} not supported; use one of "
             f"{_HF_ACTIVATIONS}")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(_LAYER_TYPES))
        need(not bad, f"unknown layer_types {bad}; known: {_LAYER_TYPES}")
        if "hybrid_sliding" in self.layer_types:
            need(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                 "sliding_window must be a positive integer when layer_types contains 'hybrid_sliding'")
        for t in set(self.layer_types):
            need(t in self.rope, f"no rope parameters for layer type {t!r}")
            r = self.rope[t]
            need(r.theta > 0, f"rope_theta for {t!r} must be > 0, got {r.theta}")
            need(0 < r.partial_rotary_factor <= 1, f"partial_rotary_factor for {t!r} must be in (0, 1]")
            rd = int(self.head_dim * r.partial_rotary_factor)
            need(rd >= 2 and rd % 2 == 0, f"rotary dim head_dim*partial_rotary_factor = {rd} must be even and >= 2")
        need(len({self.rotary_dim_for(t) for t in set(self.layer_types)}) == 1,
             "all layer types must share one rotary dimension (partial_rotary_factor)")
        need(self.attention_dropout == 0.0, "attention_dropout > 0 is not supported (ZAYA1 trains without it)")
        need(self.dtype in COMPUTE_DTYPES, f"dtype {self.dtype!r} not supported")
        need(self.param_dtype in PARAM_DTYPES, f"param_dtype {self.param_dtype!r} not supported")
        for name, allowed in IMPLS.items():
            need(getattr(self, name) in allowed, f"{name} {getattr(self, name)!r} unknown (use one of {allowed})")
        if self.vocab_size % 64:
            warnings.warn(f"vocab_size {self.vocab_size} is not a multiple of 64; GEMMs over the vocabulary run "
                          f"slower (ZAYA1 pads 262144 -> 262272)", stacklevel=3)

    # ----------------------------------------------------------------------------------------------------------
    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def conv_channels(self) -> int:
        return (self.num_attention_heads + self.num_key_value_heads) * self.head_dim

    @property
    def conv_halo(self) -> int:
        """Past q/k columns the two causal convolutions need (the CCA boundary for caches and context parallel)."""
        return (self.cca_time0 - 1) + (self.cca_time1 - 1)

    @property
    def rotary_dim(self) -> int:
        return self.rotary_dim_for(self.layer_types[0])

    def rotary_dim_for(self, layer_type: str) -> int:
        return int(self.head_dim * self.rope[layer_type].partial_rotary_factor)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- Hugging Face config.json -----------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> "ModelConfig":
        if d.get("model_type") not in (None, "zaya"):
            raise ConfigError(f"config.json describes a {d.get('model_type')!r} model, not a ZAYA ('zaya') model")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope"}
        nullable = {"layer_types", "sliding_window", "pad_token_id", "bos_token_id", "eos_token_id"}
        kw = {k: d[k] for k in names if k in d and (d[k] is not None or k in nullable)}
        if isinstance(kw.get("eos_token_id"), list) and len(kw["eos_token_id"]) == 1:
            kw["eos_token_id"] = kw["eos_token_id"][0]
        kw["rope"] = _rope_from_hf(d)
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope", "dtype", "param_dtype", "attention_impl", "norm_impl", "ce_impl", "conv_impl",
                               "moe_impl", "solve_impl", "remat", "scan_layers")}
        d["layer_types"] = list(self.layer_types)
        d["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": r.theta,
                                    "partial_rotary_factor": r.partial_rotary_factor} for t, r in self.rope.items()}
        d.update(model_type="zaya", architectures=["ZayaForCausalLM"], use_cache=True)
        return d

    # ---- parameter counts (no allocation) ---------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Exact parameter counts: 'total', 'embedding', 'non_embedding', 'active_non_embedding'."""
        D, L, E, I, R = (self.hidden_size, self.num_hidden_layers, self.num_experts, self.moe_intermediate_size,
                         self.router_hidden_size)
        H, KV, d = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        C, bias = self.conv_channels, int(self.attention_bias)
        attn = (D * H * d + D * KV * d + 2 * D * (KV * d // 2) + H * d * D
                + bias * (H * d + KV * d + KV * d + D)
                + C * self.cca_time0 + C + C * d * self.cca_time1 + C + KV)
        router = R * D + R + R + 2 * (R * R + R) + (E + 1) * R
        experts = E * (2 * I * D + D * I)
        per_layer = attn + router + experts + 2 * D + 8 * D
        embed = self.vocab_size * D
        head = (0 if self.tie_word_embeddings else self.vocab_size * D) + int(self.lm_head_bias) * self.vocab_size
        non_embed = L * per_layer + (L - 1) * R + 2 * D + D
        active = non_embed - L * (E - 1) * (2 * I * D + D * I)
        return {"total": non_embed + embed + head, "embedding": embed + head, "non_embedding": non_embed,
                "active_non_embedding": active}


def _rope_from_hf(d: dict[str, Any]) -> dict[str, RopeConfig]:
    rp = d.get("rope_parameters")
    defaults = ModelConfig.__dataclass_fields__["rope"].default_factory()
    if rp is None:  # older configs: flat rope_theta / partial_rotary_factor
        if "rope_theta" not in d:
            return defaults
        r = RopeConfig(float(d["rope_theta"]), float(d.get("partial_rotary_factor", 0.5)))
        return {t: r for t in _LAYER_TYPES}
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters must be a dict, got {type(rp).__name__}")
    per_type = {k: v for k, v in rp.items() if k in _LAYER_TYPES}
    if not per_type:  # one flat dict for every layer type
        per_type = {t: rp for t in _LAYER_TYPES}
    out = dict(defaults)
    for t, p in per_type.items():
        if p is None:
            continue
        if p.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {p['rope_type']!r} for {t!r} is not supported (ZAYA uses 'default')")
        out[t] = RopeConfig(float(p.get("rope_theta", defaults[t].theta)), float(p.get("partial_rotary_factor", 1.0)))
    return out


# ---- presets ----------------------------------------------------------------------------------------------------

def zaya1_8b(**kw) -> ModelConfig:
    """The released ZAYA1-8B (the Hugging Face defaults)."""
    return ModelConfig(**kw)


def zaya1_base(**kw) -> ModelConfig:
    """ZAYA1-base as released after 32k mid-training (rope theta 1e6, 32k positions)."""
    base = dict(rope={"hybrid": RopeConfig(1_000_000.0), "hybrid_sliding": RopeConfig(10_000.0)},
                max_position_embeddings=32768, eos_token_id=1)
    return ModelConfig(**{**base, **kw})


def bench(**kw) -> ModelConfig:
    """ZAYA1-8B widths with 8 layers: the single-GPU throughput benchmark model."""
    return ModelConfig(**{"num_hidden_layers": 8, **kw})


def tiny(**kw) -> ModelConfig:
    """CPU default: trains in minutes on 2 cores, every structural feature of ZAYA1 kept (GQA 4, 8 experts)."""
    base = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, moe_intermediate_size=128, num_experts=8, router_hidden_size=32,
                rope={"hybrid": RopeConfig(10_000.0), "hybrid_sliding": RopeConfig(10_000.0)},
                max_position_embeddings=4096, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    return ModelConfig(**{**base, **kw})


PRESETS = {"tiny": tiny, "zaya1_base": zaya1_base, "zaya1_8b": zaya1_8b, "bench": bench}


def preset(name: str, **kw) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](**kw)


def human_count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M"


__all__ = ["COMPUTE_DTYPES", "PARAM_DTYPES", "ConfigError", "ModelConfig", "RopeConfig", "PRESETS", "preset", "tiny",
           "zaya1_8b", "zaya1_base", "bench", "human_count"]

"""Model FLOPs per token, the one definition MFU uses everywhere.

6 x (active matmul parameters: q/k/v/o projections, router down/fc1/fc2/out_proj, ONE expert's gate_up and down,
and the (tied) vocabulary head) + causal attention in the compressed width: per layer and token
3 (fwd + bwd) x 2 matmuls (QK^T, PV) x 2 flops x (T / 2 visible keys on average) x H*d = 6 * T * H*d.
The CCA convolutions (~0.4% of the total at ZAYA1 widths) and elementwise work are not counted, matching the
convention the issue's reference figure (4.31 GFLOP/token for the bench preset at T = 4096) uses.
"""

from zaya_jax.config import ModelConfig


def active_matmul_params(cfg: ModelConfig) -> int:
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    R, E, I = cfg.router_hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    attn = D * H * d + D * KV * d + D * KV * d + H * d * D  # q, k, v (current + delayed halves), o
    router = D * R + 2 * R * R + R * (E + 1)
    expert = 3 * D * I
    return cfg.num_hidden_layers * (attn + router + expert) + cfg.vocab_size * D


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 6 * seq_len * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 6.0 * active_matmul_params(cfg) + attention


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops

"""Human-readable model summaries (parameter counts as the paper quotes them: non-embedding total / active)."""

from zaya_jax.config import ModelConfig


def _fmt(n: int, digits: int) -> str:
    return f"{n / 1e9:.{digits}f}B" if n >= 1e8 else f"{n / 1e6:.{digits}f}M"


def describe(cfg: ModelConfig) -> str:
    c = cfg.param_counts()
    return (f"ZAYA model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} q heads / "
            f"{cfg.num_key_value_heads} kv heads x {cfg.head_dim}, {cfg.num_experts} experts (top-1 + skip), "
            f"vocab {cfg.vocab_size}\n"
            f"  parameters: non-embedding total {_fmt(c['non_embedding'], 2)}, active "
            f"{_fmt(c['active_non_embedding'], 3)}, embedding {_fmt(c['embedding'], 3)}, total {_fmt(c['total'], 2)}")

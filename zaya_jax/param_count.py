"""Parameter counts read off an abstract model (nnx.eval_shape: shapes only, nothing allocated), in the terms the
paper quotes: non-embedding total and active (one expert per token) parameters.

Independent of the closed-form ModelConfig.param_counts(); tests pin the two (and the HF model) together.
"""

from __future__ import annotations

import math

from flax import nnx

from zaya_jax.config import ModelConfig


def abstract_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """'total', 'embedding' (embedding + untied head + head bias), 'non_embedding', 'active_non_embedding'."""
    from zaya_jax.model import ZayaForCausalLM  # deferred: keeps `import zaya_jax.param_count` light

    model = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    sizes = {"/".join(map(str, path)): math.prod(var.shape)
             for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    total = sum(sizes.values())
    embedding = sum(n for name, n in sizes.items() if name.startswith(("model/embed_tokens/", "lm_head/")))
    experts = sum(n for name, n in sizes.items() if name.startswith("model/layers/mlp/experts/"))
    inactive = experts // cfg.num_experts * (cfg.num_experts - 1)  # top-1: one expert's weights per token
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding,
            "active_non_embedding": total - embedding - inactive}


def format_param_counts(counts: dict[str, int]) -> str:
    """e.g. 'non-embedding parameters: 8.30B total / 0.754B active (embedding 0.537B, all 8.84B)': three
    significant digits, in the unit (B or M) of the non-embedding total."""
    scale, unit = (1e9, "B") if counts["non_embedding"] >= 1e9 else (1e6, "M")

    def fmt(n: int) -> str:
        x = n / scale
        digits = max(0, 2 - math.floor(math.log10(x))) if x > 0 else 0
        return f"{x:.{digits}f}{unit}"

    return (f"non-embedding parameters: {fmt(counts['non_embedding'])} total / "
            f"{fmt(counts['active_non_embedding'])} active "
            f"(embedding {fmt(counts['embedding'])}, all {fmt(counts['total'])})")

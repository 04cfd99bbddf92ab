"""A quick health check of a loaded checkpoint: parameter counts and a forward-pass logits checksum on fixed
tokens, so two loads (or two conversions) of the same weights can be compared by eye or by script."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.model import ZayaForCausalLM
from zaya_jax.param_count import format_param_counts


def loaded_param_counts(model: ZayaForCausalLM) -> dict[str, int]:
    """Counts of the concrete model's parameters (balancing biases are state, not parameters)."""
    sizes = {"/".join(map(str, p)): math.prod(v.shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    total = sum(sizes.values())
    embedding = sum(n for k, n in sizes.items() if k.startswith(("model/embed_tokens/", "lm_head/")))
    cfg = model.cfg
    experts = sum(n for k, n in sizes.items() if k.startswith("model/layers/mlp/experts/"))
    active = total - embedding - experts // cfg.num_experts * (cfg.num_experts - 1)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding,
            "active_non_embedding": active}


def check_tokens(vocab_size: int, batch: int = 2, length: int = 16) -> jax.Array:
    """Deterministic token ids in [1, vocab) (no padding token), the same on every machine."""
    return jnp.asarray((np.arange(batch * length).reshape(batch, length) * 7919 + 13) % (vocab_size - 1) + 1)


def logits_checksum(model: ZayaForCausalLM, batch: int = 2, length: int = 16) -> dict[str, float]:
    logits, aux = jax.jit(lambda ids: model.forward(ids))(check_tokens(model.cfg.vocab_size, batch, length))
    x = np.asarray(logits, np.float64)
    return {"sum": float(x.sum()), "abs_sum": float(np.abs(x).sum()), "std": float(x.std()),
            "first": float(x[0, 0, 0]), "finite": bool(np.isfinite(x).all()),
            "skip_tokens": int(np.asarray(aux.expert_counts)[:, -1].sum())}


def check_report(model: ZayaForCausalLM) -> str:
    c = logits_checksum(model)
    return "\n".join([
        f"config: {model.cfg.num_hidden_layers} layers, hidden {model.cfg.hidden_size}, "
        f"{model.cfg.num_experts} experts, vocab {model.cfg.vocab_size}, compute dtype {model.cfg.dtype}",
        format_param_counts(loaded_param_counts(model)),
        f"logits checksum on fixed tokens [2 x 16]: sum {c['sum']:.6e} abs_sum {c['abs_sum']:.6e} "
        f"std {c['std']:.6f} first {c['first']:.6f} finite {c['finite']} skip-routed tokens {c['skip_tokens']}",
    ])

"""Next-token cross-entropy, the only ZAYA1 training loss (no auxiliary router or z-loss in any reference).

Same definition as the Hugging Face causal-LM loss: logits in fp32, position t predicts labels[t + 1], labels equal
to `ignore_index` (padding, prompt tokens) count for nothing, mean over the counted tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100


def token_cross_entropy_terms(logits, targets, mask):
    """Aligned targets (logits[t] predicts targets[t]): per-token fp32 CE [B, T] (0 where mask is 0) and the mask."""
    logits = logits.astype(jnp.float32)
    counted = mask.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.where(counted > 0, log_z - target_logit, 0.0), counted


def next_token_loss_terms(logits, labels, ignore_index: int = IGNORE_INDEX):
    """Per-token losses [B, T-1] (0 where ignored) and the mask of counted tokens [B, T-1] (float32)."""
    targets = labels[:, 1:]
    counted = targets != ignore_index
    safe_targets = jnp.where(counted, targets, 0)  # any valid index; the term is masked out
    return token_cross_entropy_terms(logits[:, :-1], safe_targets, counted)


def next_token_cross_entropy(logits, labels, ignore_index: int = IGNORE_INDEX):
    """Mean next-token CE over counted tokens; 0 (not NaN, unlike torch) when no token counts."""
    terms, counted = next_token_loss_terms(logits, labels, ignore_index)
    return terms.sum() / jnp.maximum(counted.sum(), 1.0)

"""Next-token choice from fp32 logits: greedy, or temperature / top-k / top-p sampling with a PRNG key.

The filters follow HF's logits warpers in HF's order (temperature, then top-k, then top-p): top-k keeps every
token scoring at least the k-th best (ties kept); top-p keeps the smallest highest-probability set whose mass
reaches p, and always the best token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_MASKED = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax; the key is unused)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def top_k_filter(logits, k: int):
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, _MASKED, logits)


def top_p_filter(logits, p: float):
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < p
    keep_sorted = keep_sorted.at[..., 0].set(True)
    # the kept set is a prefix of the sorted order: its smallest logit is the threshold
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, _MASKED, logits)


def filtered_logits(logits, sampling: Sampling):
    """The logits a sampler draws from: scaled by 1/temperature, everything outside top-k / top-p at -inf."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        logits = top_k_filter(logits, min(sampling.top_k, logits.shape[-1]))
    if sampling.top_p < 1.0:
        logits = top_p_filter(logits, sampling.top_p)
    return logits


def choose(logits, key, sampling: Sampling):
    """logits [B, V] -> token ids [B] int32."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, sampling), axis=-1).astype(jnp.int32)

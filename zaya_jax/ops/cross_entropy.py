"""Softmax cross-entropy of rows of logits with its logit gradient, as the chunked head loss uses it.

    softmax_xent(logits [N, V], targets [N], weights [N], impl) -> (loss [N] fp32, d_logits [N, V] logits.dtype)
    loss = weights * (logsumexp(logits) - logits[target]) (0 where weights == 0),
    d_logits = weights * (softmax(logits) - onehot(target)), rounded once to the logits' dtype.

'xla' is the jnp reference below; 'pallas' the one-kernel version (pallas_kernels/softmax_xent.py: two reads and one
write of the logits, fewer than XLA's fusions of the reference; docs/experiments.md). Statistics in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def log_partition(logits):
    """fp32 log-sum-exp over the last axis of compute-dtype logits. The row maximum is taken in the logits' own
    dtype (exact), so the fp32 upcast only feeds the exp-sum reduction."""
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1).astype(F32))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top + jnp.log(jnp.sum(jnp.exp(logits.astype(F32) - top[..., None]), axis=-1))


def _loss_and_lse(logits, targets, weights):
    weights = weights.astype(F32)
    lse = log_partition(logits)
    # gathered before the upcast: a gather consumer of the fp32 logits can make XLA write them all out
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0].astype(F32)
    return jnp.where(weights != 0, weights * (lse - picked), 0.0), lse


def softmax_xent_loss(logits, targets, weights):
    """The loss [N] of softmax_xent alone (no gradient pass), for forward-only evaluation."""
    return _loss_and_lse(logits, targets, weights)[0]


def softmax_xent_reference(logits, targets, weights):
    weights = weights.astype(F32)
    loss, lse = _loss_and_lse(logits, targets, weights)
    probs = jnp.exp(logits.astype(F32) - lse[:, None])
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=F32)
    return loss, ((probs - onehot) * weights[:, None]).astype(logits.dtype)


IMPLS = ("xla", "pallas")


def softmax_xent(logits, targets, weights, impl: str = "xla"):
    if impl == "xla":
        return softmax_xent_reference(logits, targets, weights)
    if impl == "pallas":
        from pallas_kernels.softmax_xent import softmax_xent as kernel
        return kernel(logits, targets, weights)
    raise ValueError(f"cross-entropy impl {impl!r} unknown (use one of {IMPLS})")

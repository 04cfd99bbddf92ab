"""Next-token cross-entropy: shift, ignore_index, mean over counted tokens (HF parity is in test_hf_parity)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.model.loss import IGNORE_INDEX, next_token_cross_entropy

loss_fn = jax.jit(next_token_cross_entropy)  # one compile per input shape instead of one per eager op


def numpy_loss(logits, labels):
    logits = logits.astype(np.float64)
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = labels[b, t + 1]
            if target == IGNORE_INDEX:
                continue
            row = logits[b, t]
            total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[target]
            count += 1
    return total / count


def test_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 7, 11)).astype(np.float32) * 3
    labels = rng.integers(0, 11, size=(2, 7))
    labels[0, :3] = IGNORE_INDEX
    labels[1, 5] = IGNORE_INDEX
    got = float(loss_fn(jnp.asarray(logits), jnp.asarray(labels)))
    np.testing.assert_allclose(got, numpy_loss(logits, labels), rtol=1e-6)


def test_ignored_positions_get_no_gradient_and_bf16_logits_are_upcast():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, 5, 6)), jnp.bfloat16)
    labels = jnp.asarray([[3, IGNORE_INDEX, 2, 4, IGNORE_INDEX]])
    grad = jax.jit(jax.grad(loss_fn))(logits, labels)
    # position t is scored against labels[t + 1]: positions 0 and 3 (ignored targets) and 4 (no next token)
    assert not np.any(np.asarray(grad[0, [0, 3, 4]], np.float32))
    assert np.all(np.any(np.asarray(grad[0, [1, 2]], np.float32) != 0, axis=-1))
    assert loss_fn(logits, labels).dtype == jnp.float32


def test_no_counted_token_gives_zero_not_nan():
    logits = jnp.zeros((1, 4, 3))
    labels = jnp.full((1, 4), IGNORE_INDEX)
    assert float(loss_fn(logits, labels)) == 0.0

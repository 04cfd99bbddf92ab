"""The ZAYA1 model gives the same logits, loss and gradients with the Pallas kernels switched on as with XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax import config as zc
from zaya_jax.model import ZayaForCausalLM


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _logits_and_grads(cfg, ids, mask):
    model = ZayaForCausalLM(cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # temp initialises to 0 (all keys zero, uniform attention); 1.5 makes the attention pattern non-trivial.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, 1.5) if "temp" in jax.tree_util.keystr(path) else x, params)

    @jax.jit
    def run(params):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(ids, attention_mask=mask)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    return run(params)


def _parity(cfg, B, T, tol):
    ids = jax.random.randint(jax.random.key(1), (B, T), 3, cfg.vocab_size)
    mask = None  # a padding mask yields NaN gradients in the model's qk-norm itself (sqrt at 0), xla and pallas alike
    ref_logits, ref_grads = _logits_and_grads(cfg, ids, mask)
    logits, grads = _logits_and_grads(cfg.replace(attention_impl="pallas", norm_impl="pallas", conv_impl="pallas"),
                                      ids, mask)
    assert _rel(logits, ref_logits) <= tol
    # on the host: eager jnp ops would compile a program per leaf shape and op
    flat = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    ref_flat = [np.asarray(g, np.float64) for g in jax.tree.leaves(ref_grads)]
    assert len(flat) == len(ref_flat)
    # One joint relative error over all parameter gradients (some leaves are tiny).
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(flat, ref_flat))
    den = sum(float(np.sum(b ** 2)) for b in ref_flat)
    assert (num / den) ** 0.5 <= tol


def test_tiny_model_parity_interpret():
    """Unrolled layers: each layer's last merge runs fused with the next norm in the merge kernel (the kernels
    inside the layer scan: test_tiny_training_loss_parity_interpret)."""
    cfg = zc.tiny(num_hidden_layers=2, dtype="float32", vocab_size=128, scan_layers=False)
    _parity(cfg, B=1, T=20, tol=1e-4)


@pytest.mark.gpu
def test_model_parity_on_gpu():
    """ZAYA1's attention geometry (8 q / 2 kv heads of 128) in one layer: compile time, not the model's size,
    bounds this test (two full forward+backward programs, the Pallas one with five kernels)."""
    cfg = zc.tiny(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, vocab_size=256, scan_layers=False)
    _parity(cfg, B=2, T=256, tol=2e-2)


def _train_loss_and_grads(cfg, batch):
    """The trainer's loss (chunked head cross-entropy) and its parameter gradients."""
    from zaya_jax.model.base import BalancingBias
    from zaya_jax.train.step import make_loss_fn
    graphdef, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=0), nnx.Param, BalancingBias)
    loss_fn = make_loss_fn(graphdef, False, ce_chunk_tokens=24)
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, model_state, batch)
    return loss, grads


def _train_parity(cfg, B, T, tol):
    ids = jax.random.randint(jax.random.key(2), (B, T + 1), 3, cfg.vocab_size)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((B, T)),
             "source_ids": jnp.zeros((B,), jnp.int32)}
    ref_loss, ref_grads = _train_loss_and_grads(cfg, batch)
    loss, grads = _train_loss_and_grads(cfg.replace(attention_impl="pallas", norm_impl="pallas", ce_impl="pallas",
                                                    moe_impl="pallas", conv_impl="pallas"), batch)
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    flat = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]  # on the host, as in _parity
    ref_flat = [np.asarray(g, np.float64) for g in jax.tree.leaves(ref_grads)]
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(flat, ref_flat))
    den = sum(float(np.sum(b ** 2)) for b in ref_flat)
    assert (num / den) ** 0.5 <= tol
    # the grouped-GEMM kernel's weight gradients reach every expert matrix (the joint error could hide a zero leaf)
    experts = [g for p, g in jax.tree_util.tree_leaves_with_path(grads) if "experts" in jax.tree_util.keystr(p)]
    assert experts and all(float(np.abs(np.asarray(g)).max()) > 0 for g in experts)


def test_tiny_training_loss_parity_interpret():
    """Every kernel the trainer can select (attention, norms, CCA convolution, cross-entropy, grouped-GEMM experts)
    against XLA, inside the layer scan (unrolled layers: test_tiny_model_parity_interpret)."""
    _train_parity(zc.tiny(num_hidden_layers=2, dtype="float32", vocab_size=192, scan_layers=True), B=2, T=20,
                  tol=1e-4)


@pytest.mark.gpu
def test_training_loss_parity_on_gpu():
    cfg = zc.tiny(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, vocab_size=960, scan_layers=False)
    _train_parity(cfg, B=2, T=256, tol=2e-2)

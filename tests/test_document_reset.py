"""Packed documents with resets: each document of a packed row computes exactly what it computes alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import tiny
from zaya_jax.model import ZayaForCausalLM


@pytest.mark.parametrize("times", [(2, 2), (3, 2)])
def test_packed_documents_match_separate_runs(times):
    cfg = tiny(dtype="float32", num_hidden_layers=2, cca_time0=times[0], cca_time1=times[1], remat="none")
    model = ZayaForCausalLM(cfg, seed=3)
    # non-default conv biases and temperature, so the boundary behaviour matters
    layers = model.model.layers.self_attn
    for conv in (layers.qkv_proj.conv_qk_depthwise, layers.qkv_proj.conv_qk_grouped):
        conv.bias[...] = jax.random.normal(jax.random.key(1), conv.bias.shape)
    layers.qk_norm.temp[...] = jnp.full(layers.qk_norm.temp.shape, 1.5)
    a = jax.random.randint(jax.random.key(4), (1, 7), 3, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(5), (1, 9), 3, cfg.vocab_size)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[0] * 7 + [1] * 9])
    pos = jnp.array([list(range(7)) + list(range(9))])
    together = model(packed, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(together[:, :7], model(a), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(together[:, 7:], model(b), rtol=2e-5, atol=2e-5)
    # without resets the second document sees the first one
    assert not np.allclose(model(packed)[:, 7:], model(b), atol=1e-3)


def test_padded_batch_has_finite_gradients_at_default_init():
    # default init: zero conv biases, so a padded token's q/k are exactly zero before the L2 norm
    cfg = tiny(dtype="float32", num_hidden_layers=2, remat="none")
    model = ZayaForCausalLM(cfg, seed=0)
    from flax import nnx
    ids = jax.random.randint(jax.random.key(1), (2, 8), 3, cfg.vocab_size)
    mask = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # jitted (one program; an eager backward compiles every op of it separately), checked on the host
    grads = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p, rest)(ids, attention_mask=mask)[:, -1].sum()))(params)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))

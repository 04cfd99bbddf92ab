"""The chunked head cross-entropy (zaya_jax/model/loss.py) against the full-logits loss: values and gradients in
fp32 (tight), in bf16 (the head-gradient GEMMs take bf16 operands: loose), padding of the last chunk, the head bias,
masked tokens, a precast compute-dtype copy of the weight (the same values and gradients, exactly; the copy gets
none), and the train step's loss with and without chunking on a tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.model.loss import chunked_head_cross_entropy, token_cross_entropy_terms
from zaya_jax.train.step import make_loss_fn


def full_loss(hidden, weight, bias, targets, mask):
    logits = jnp.einsum("...d,vd->...v", hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    logits = logits.astype(hidden.dtype).astype(jnp.float32)  # HF's lm_head returns compute-dtype logits
    terms, counted = token_cross_entropy_terms(logits, targets, mask)
    return terms.sum() / jnp.maximum(counted.sum(), 1.0)


def chunked_loss(hidden, weight, bias, targets, mask, chunk):
    total, counted = chunked_head_cross_entropy(hidden, weight, targets, mask, bias=bias, chunk_tokens=chunk)
    return total / jnp.maximum(counted, 1.0)


def inputs(seed, B=3, T=10, D=16, V=40, dtype=jnp.float32, with_bias=False):
    ks = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(ks[0], (B, T, D)).astype(dtype)
    weight = jax.random.normal(ks[1], (V, D)) * 0.5
    bias = jax.random.normal(ks[2], (V,)) * 0.3 if with_bias else None
    targets = jax.random.randint(ks[3], (B, T), 0, V)
    mask = (jax.random.uniform(ks[4], (B, T)) > 0.25).astype(jnp.float32)
    return hidden, weight, bias, targets, mask


@pytest.mark.parametrize("chunk", [1, 7, 30, 64])  # 30 tokens: uneven last chunk, one chunk, more than all tokens
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_value_and_gradients_match_full_logits(chunk, with_bias):
    hidden, weight, bias, targets, mask = inputs(chunk + 10 * with_bias, with_bias=with_bias)
    argnums = (0, 1, 2) if with_bias else (0, 1)
    ref, ref_g = jax.value_and_grad(full_loss, argnums)(hidden, weight, bias, targets, mask)
    got, got_g = jax.jit(jax.value_and_grad(chunked_loss, argnums), static_argnums=5)(hidden, weight, bias, targets,
                                                                                       mask, chunk)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    for a, b in zip(got_g, ref_g):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # the primal path (no gradient) gives the same value
    np.testing.assert_allclose(jax.jit(chunked_loss, static_argnums=5)(hidden, weight, bias, targets, mask, chunk),
                               ref, rtol=1e-6)


@pytest.mark.parametrize("chunk", [7, 64])  # several chunks, one chunk
def test_mean_option_is_the_token_mean_with_its_gradients(chunk):
    hidden, weight, bias, targets, mask = inputs(20 + chunk, with_bias=True)

    def mean_loss(hidden, weight, bias):
        return chunked_head_cross_entropy(hidden, weight, targets, mask, bias=bias, chunk_tokens=chunk, mean=True)[0]

    ref, ref_g = jax.value_and_grad(full_loss, (0, 1, 2))(hidden, weight, bias, targets, mask)
    got, got_g = jax.jit(jax.value_and_grad(mean_loss, (0, 1, 2)))(hidden, weight, bias)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    for a, b in zip(got_g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    none = jnp.zeros_like(mask)
    total, counted = chunked_head_cross_entropy(hidden, weight, targets, none, chunk_tokens=chunk, mean=True)
    assert float(total) == 0.0 and float(counted) == 0.0


def test_one_chunk_head_gradient_leaves_in_the_weight_dtype_rounded_once():
    """With one chunk the head-weight gradient comes out of its GEMM in the weight's dtype (the bf16 weights of the
    accumulating step's compute view): the fp32 gradient rounded once to bf16, not a bf16-accumulated sum."""
    hidden, weight, _, targets, mask = inputs(9, B=2, T=64, D=64, V=300, dtype=jnp.bfloat16)

    def mean_loss(weight):
        return chunked_head_cross_entropy(hidden, weight, targets, mask, chunk_tokens=128, mean=True)[0]

    exact = jax.jit(jax.grad(mean_loss))(weight.astype(jnp.bfloat16).astype(jnp.float32))
    got = jax.jit(jax.grad(mean_loss))(weight.astype(jnp.bfloat16))
    assert exact.dtype == jnp.float32 and got.dtype == jnp.bfloat16
    exact, got = np.asarray(exact), np.asarray(got, np.float32)
    assert np.all(np.abs(got - exact) <= 2.0 ** -8 * np.abs(exact) + 1e-12)
    assert np.abs(got - exact).max() > 0  # really rounded: the comparison is not of two fp32 arrays


def test_masked_tokens_get_no_gradient_and_all_masked_is_zero():
    hidden, weight, _, targets, mask = inputs(3)
    mask = mask.at[1].set(0.0)
    g = jax.grad(chunked_loss)(hidden, weight, None, targets, mask, 4)
    assert np.all(np.asarray(g[1]) == 0)
    zero = jnp.zeros_like(mask)
    assert float(chunked_loss(hidden, weight, None, targets, zero, 4)) == 0.0
    assert np.all(np.isfinite(np.asarray(jax.grad(chunked_loss)(hidden, weight, None, targets, zero, 4))))


def test_bf16_matches_within_bf16_rounding():
    hidden, weight, _, targets, mask = inputs(5, B=2, T=64, D=64, V=300, dtype=jnp.bfloat16)
    ref, (rh, rw) = jax.value_and_grad(full_loss, (0, 1))(hidden, weight, None, targets, mask)
    got, (gh, gw) = jax.value_and_grad(chunked_loss, (0, 1))(hidden, weight, None, targets, mask, 48)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=1e-6)  # the same logits: fp32-accumulated GEMM rounded to bf16 once
    for a, b in ((gh, rh), (gw, rw)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


@pytest.mark.parametrize("chunk", [48, 200])  # several chunks (fp32 sums), one chunk (the gradient out of its GEMM)
def test_a_precast_weight_copy_gives_the_same_values_and_gradients(chunk):
    hidden, weight, _, targets, mask = inputs(6, B=2, T=64, D=64, V=300, dtype=jnp.bfloat16)

    def loss(hidden, weight, copy):
        return chunked_head_cross_entropy(hidden, weight, targets, mask, chunk_tokens=chunk, mean=True,
                                          weight_compute=copy)[0]

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    want, (wh, ww, _) = grad(hidden, weight, None)
    got, (gh, gw, g_copy) = grad(hidden, weight, weight.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert gw.dtype == jnp.float32 and not np.asarray(g_copy, np.float32).any()
    np.testing.assert_array_equal(np.asarray(gh, np.float32), np.asarray(wh, np.float32))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(ww))
    with pytest.raises(ValueError, match="weight_compute must be weight"):
        loss(hidden, weight, weight)  # fp32: not the hidden states' dtype


@pytest.mark.slow  # the chunked loss against full logits by default: the tests above, test_compute_view
def test_train_loss_with_chunked_head_equals_full_head():
    cfg = preset("tiny", remat="none", dtype="float32")
    model = ZayaForCausalLM(cfg, seed=0)
    graphdef, params, state = nnx.split(model, nnx.Param, BalancingBias)
    params, state = nnx.to_pure_dict(params), nnx.to_pure_dict(state)
    B, T = 2, 24
    ids = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
    batch = dict(inputs=ids[:, :-1], targets=ids[:, 1:], loss_mask=jnp.ones((B, T)),
                 source_ids=jnp.array([0, -1], jnp.int32))  # second row: padding, never counted
    full = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, False), has_aux=True))
    chunked = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, False, ce_chunk_tokens=10), has_aux=True))
    (l0, c0), g0 = full(params, state, batch)
    (l1, c1), g1 = chunked(params, state, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_array_equal(c1, c0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)

"""The softmax cross-entropy kernel (pallas_kernels/softmax_xent.py) against the jnp reference
(zaya_jax/ops/cross_entropy.py): interpret mode on the CPU, the compiled kernel with `-m gpu`; and the chunked head
loss with it against the same loss with the reference, value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_rmsnorm import TOL, rel_err

from pallas_kernels import softmax_xent as pk
from zaya_jax.model.loss import chunked_head_cross_entropy
from zaya_jax.ops.cross_entropy import softmax_xent, softmax_xent_reference


def problem(seed, n, vocab, dtype):
    k = jax.random.split(jax.random.key(seed), 3)
    logits = (4.0 * jax.random.normal(k[0], (n, vocab)) + 1.0).astype(dtype)
    targets = jax.random.randint(k[1], (n,), 0, vocab)
    # counted, ignored and fractionally weighted rows
    weights = jnp.where(jnp.arange(n) % 3 == 1, 0.0, jax.random.uniform(k[2], (n,), minval=0.5, maxval=1.5))
    return logits, targets, weights


def check(got, want, dtype):
    (loss, d), (loss_ref, d_ref) = got, want
    assert loss.dtype == jnp.float32 and d.dtype == d_ref.dtype == dtype and d.shape == d_ref.shape
    assert rel_err(loss, loss_ref) <= TOL[dtype]
    assert rel_err(d.astype(jnp.float32), d_ref.astype(jnp.float32)) <= TOL[dtype]
    ignored = np.asarray(want[0]) == 0
    assert np.all(np.asarray(loss)[ignored] == 0) and np.all(np.asarray(d, np.float32)[ignored] == 0)


# vocabularies below, at and across the interpreter's 512-column block, none of them whole blocks but 2048
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,vocab", [(7, 300), (6, 1000), (5, 2048), (4, 1537)])
def test_kernel_matches_the_reference(n, vocab, dtype):
    logits, targets, weights = problem(n * vocab, n, vocab, dtype)
    check(softmax_xent(logits, targets, weights, "pallas"), softmax_xent_reference(logits, targets, weights), dtype)


@pytest.mark.parametrize("prefetch,reverse", [(0, False), (2, False), (0, True), (2, True)])
def test_kernel_with_other_launches(prefetch, reverse):
    """Prefetch depths, with the second pass from the row's end (the default) or from its start."""
    logits, targets, weights = problem(prefetch + 3 * reverse, 5, 1500, jnp.float32)
    launch = pk.XentLaunch(block=256, num_warps=4, prefetch=prefetch, reverse=reverse)
    check(pk.softmax_xent(logits, targets, weights, launch), softmax_xent_reference(logits, targets, weights),
          jnp.float32)


def test_the_reference_is_the_softmax_cross_entropy_and_its_gradient():
    logits, targets, weights = problem(0, 6, 50, jnp.float32)

    def loss(x):
        logp = jax.nn.log_softmax(x, axis=-1)
        return -(weights * jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0])

    got_loss, got_d = softmax_xent_reference(logits, targets, weights)
    np.testing.assert_allclose(got_loss, loss(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_d, jax.grad(lambda x: loss(x).sum())(logits), rtol=1e-5, atol=1e-6)


def test_unknown_impl_is_rejected():
    logits, targets, weights = problem(0, 2, 10, jnp.float32)
    with pytest.raises(ValueError, match="cross-entropy impl 'triton' unknown"):
        softmax_xent(logits, targets, weights, "triton")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_chunked_head_loss_with_the_kernel_matches_the_reference(with_bias):
    n, d, vocab = 40, 32, 700  # 3 chunks of 16 tokens, the last one padded
    k = jax.random.split(jax.random.key(1), 5)
    hidden = jax.random.normal(k[0], (2, n // 2, d), jnp.float32)
    weight = 0.3 * jax.random.normal(k[1], (vocab, d), jnp.float32)
    bias = 0.1 * jax.random.normal(k[2], (vocab,), jnp.float32) if with_bias else None
    targets = jax.random.randint(k[3], (2, n // 2), 0, vocab)
    mask = (jax.random.uniform(k[4], (2, n // 2)) > 0.2).astype(jnp.float32)

    def total(impl):
        def f(h, w, b):
            return chunked_head_cross_entropy(h, w, targets, mask, bias=b, chunk_tokens=16, impl=impl)[0]
        return jax.value_and_grad(f, argnums=(0, 1, 2) if with_bias else (0, 1))(hidden, weight, bias)

    (got, got_grads), (want, want_grads) = total("pallas"), total("xla")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_kernel_on_the_gpu_at_the_zaya1_vocabulary(dtype):
    logits, targets, weights = problem(3, 64, 262272, dtype)
    check(jax.jit(lambda *a: softmax_xent(*a, "pallas"))(logits, targets, weights),
          jax.jit(softmax_xent_reference)(logits, targets, weights), dtype)


def test_chunked_head_loss_value_is_the_same_with_and_without_gradients():
    """The forward-only path and the differentiated path count fractionally weighted tokens alike."""
    k = jax.random.split(jax.random.key(4), 4)
    hidden = jax.random.normal(k[0], (30, 16), jnp.float32)
    weight = 0.3 * jax.random.normal(k[1], (90, 16), jnp.float32)
    targets = jax.random.randint(k[2], (30,), 0, 90)
    mask = jax.random.uniform(k[3], (30,), minval=0.0, maxval=2.0) * (jnp.arange(30) % 4 != 0)

    def f(h):
        return chunked_head_cross_entropy(h, weight, targets, mask, chunk_tokens=8)[0]

    np.testing.assert_allclose(f(hidden), jax.value_and_grad(f)(hidden)[0], rtol=1e-6)

"""Bucketed log-likelihood scoring equals a plain forward per request: sums of continuation log-probabilities and
greedy flags, for requests of many lengths sorted into batches of fixed-shape buckets (right padding), including a
context cut on the left at max_length. Rolling windows predict every token once with maximal context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference.jax_side import random_model

from zaya_jax.config import tiny
from zaya_jax.inference.scoring import Scorer, default_buckets, rolling_windows

CFG = tiny(dtype="float32", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, router_hidden_size=8,
           remat="none")


def jitted(model):
    return jax.jit(lambda ids: model(ids))


def direct(forward, context, continuation, max_length):
    """One forward over the (left-cut) request, unpadded."""
    full = (context + continuation)[-(max_length + 1):]
    logits = forward(jnp.asarray([full[:-1]]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    n = len(continuation)
    pos = np.arange(len(full) - 1 - n, len(full) - 1)
    targets = np.asarray(full[1:])[-n:]
    greedy = bool((np.asarray(logits).argmax(-1)[pos] == targets).all())
    return float(logp[pos, targets].sum()), greedy


def test_bucketed_scores_equal_direct_forward():
    model = random_model(CFG, seed=5)
    max_length = 40
    scorer = Scorer(model, max_length=max_length, batch_size=4, buckets=(16, 40))
    rng = np.random.default_rng(0)
    # (context, continuation) lengths whose inputs are 7, 14 or 40 tokens long (few shapes: few compiles of the
    # direct forward); (50, 7) is cut on the left to 40 inputs, (30, 11) fits exactly; the first batch of 4 is in
    # the 40 bucket, where the head runs over a 32-position window that ends inside (28, 9)'s row and that holds
    # all of (2, 13)'s
    shapes = [(1, 7), (3, 5), (7, 1), (12, 3), (2, 13), (50, 7), (30, 11), (28, 9)]
    requests = [(rng.integers(1, CFG.vocab_size, a).tolist(), rng.integers(1, CFG.vocab_size, b).tolist())
                for a, b in shapes]
    # a continuation that is the model's own greedy choice: its greedy flag must be True
    forward = jitted(model)
    context = requests[1][0] + [9, 4, 7, 1, 8]
    requests.append((context, [int(np.asarray(forward(jnp.asarray([context])))[0, -1].argmax())]))

    got = scorer.loglikelihood(requests)
    for (context, continuation), (logp, greedy) in zip(requests, got):
        want_logp, want_greedy = direct(forward, context, continuation, max_length)
        assert logp == pytest.approx(want_logp, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy
    assert got[-1][1]
    assert set(scorer._compiled) == {(16, 16), (40, 32)}


def test_rolling_windows_predict_every_token_once():
    # lm_eval's documented example: tokens 0..9, max length 4, prefix P
    P = -1
    assert rolling_windows(list(range(10)), 4, P) == [([P], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]),
                                                      ([5, 6, 7], [8, 9])]
    for n in range(1, 30):
        for max_length in (1, 2, 5, 8):
            tokens = list(range(100, 100 + n))
            windows = rolling_windows(tokens, max_length, P)
            assert [t for _, cont in windows for t in cont] == tokens
            full = [P] + tokens
            for context, cont in windows:
                assert len(context) + len(cont) - 1 <= max_length
                end = full.index(cont[-1]) + 1
                assert (context + cont) == full[end - len(context) - len(cont):end]  # contiguous text
            last_context, last_cont = windows[-1]
            assert len(last_context) + len(last_cont) - 1 == min(max_length, n)  # the last window is full


def test_rolling_loglikelihood_of_a_short_document_is_its_forward():
    model = random_model(CFG, seed=5)
    doc = list(range(3, 23))
    scorer = Scorer(model, max_length=32, batch_size=2, buckets=(32,))
    logp = np.asarray(jax.nn.log_softmax(jitted(model)(jnp.asarray([[2] + doc[:-1]]))[0], axis=-1))
    want = logp[np.arange(len(doc)), doc].sum()
    assert scorer.loglikelihood_rolling([doc], prefix_token=2)[0] == pytest.approx(float(want), rel=1e-5)
    assert default_buckets(100) == (32, 64, 100)


def test_scorers_and_a_decoder_share_one_copy_of_the_weights():
    """inference_state(model) passed as state=: the same arrays (no copy each), the same scores and logits."""
    from zaya_jax.inference.decoder import Decoder, inference_state

    model = random_model(CFG, seed=7)
    shared = inference_state(model)
    scorers = [Scorer(model, max_length=16, batch_size=2, buckets=(16,), state=shared) for _ in range(2)]
    decoder = Decoder(model, state=shared)
    held = jax.tree.leaves(shared)
    for reader in (*scorers, decoder):
        assert all(a is b for a, b in zip(jax.tree.leaves(reader.state), held, strict=True))
    requests = [([1, 5, 9], [3, 4]), ([2, 7, 7, 7, 1], [6])]
    own = Scorer(model, max_length=16, batch_size=2, buckets=(16,))
    assert scorers[1].loglikelihood(requests) == own.loglikelihood(requests)
    ids = np.array([[1, 5, 9, 3]], np.int32)
    logits = [d.prefill(d.init_cache(1, 8), ids)[0] for d in (decoder, Decoder(model))]
    np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))
    other = random_model(CFG.replace(router_hidden_size=4), seed=7)  # another model's weights are refused
    with pytest.raises(ValueError, match="not inference_state"):
        Scorer(other, max_length=16, batch_size=2, state=shared)

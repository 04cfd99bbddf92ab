"""Generation compiles per length bucket, not per prompt length: prompts, caches and decode loops of nearby lengths
share one compiled program, and the extra padding changes no generated token."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from hf_reference.jax_side import random_model

from zaya_jax.config import tiny
from zaya_jax.inference import Decoder, generate, generate_padded, left_pad, length_bucket

CFG = tiny(dtype="float32", vocab_size=128, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=8, num_hidden_layers=2,
           remat="none")


@contextlib.contextmanager
def counted_compiles():
    """A list that receives one entry per XLA compilation inside the block."""
    seen = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_buckets_hold_the_length_with_at_most_half_of_it_as_padding():
    ladder = sorted({length_bucket(n) for n in range(1, 5000)})
    assert ladder[:8] == [16, 24, 32, 48, 64, 96, 128, 192]
    for n in range(1, 5000):
        b = length_bucket(n)
        assert b >= n and (b <= 16 or b <= 1.5 * n), (n, b)
    with pytest.raises(ValueError, match="positive"):
        length_bucket(0)
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        left_pad([[1, 2, 3]], 0, length=2)


def test_nearby_prompt_and_generation_lengths_compile_once():
    decoder = Decoder(random_model(CFG, seed=3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (17, 20, 23)]  # all in bucket 24
    generate(decoder, [prompts[0]], max_new_tokens=5)  # compiles the prefill, the cache init and the decode loop
    with counted_compiles() as compiles:
        for prompt, new in zip(prompts[1:], (7, 9)):  # bucket 16 of new tokens, like 5
            out = generate(decoder, [prompt], max_new_tokens=new)
            assert out.tokens.shape == (1, new)
    assert not compiles, f"{len(compiles)} compilations for prompts and generation lengths in the same buckets"


def test_bucket_padding_changes_no_generated_token():
    decoder = Decoder(random_model(CFG, seed=5))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (9, 4)]
    bucketed = generate(decoder, prompts, max_new_tokens=12)  # padded to 16
    ids, mask = left_pad(prompts, CFG.pad_token_id, length=9)  # the least padding
    tight = generate_padded(decoder, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(bucketed.tokens, tight.tokens)
    np.testing.assert_array_equal(bucketed.lengths, [12, 12])

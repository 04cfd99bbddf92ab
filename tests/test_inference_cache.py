"""Cached decoding computes what the full forward computes: prefill a (left-padded) prompt, then feed 64 tokens
one at a time; every logit matches the full forward over prompt + tokens (fp32) with HF generate's positions
(cumsum of the attention mask - 1). Configs cover GQA groups, conv kernels 2/2 and 3/1, attention biases (the
delayed-value state then starts at the bias), a sliding-window layer next to full ones, and random non-default
values in every parameter. A token past the cache's capacity yields NaN logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference.jax_side import max_rel, random_model

from zaya_jax.config import RopeConfig, tiny
from zaya_jax.inference import Decoder, init_cache
from zaya_jax.inference.cache import chunk_positions

STEPS = 64
TOL = 1e-5
SMALL = dict(dtype="float32", vocab_size=128, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=8, remat="none")
CONFIGS = {
    "gqa2_conv22": tiny(**SMALL, num_hidden_layers=2),
    "bias_conv31_sliding": tiny(**SMALL, num_hidden_layers=3, cca_time0=3, cca_time1=1, attention_bias=True,
                                layer_types=("hybrid", "hybrid_sliding", "hybrid"), sliding_window=9,
                                rope={"hybrid": RopeConfig(5e4, 0.5), "hybrid_sliding": RopeConfig(1e3, 0.5)}),
}


def hf_positions(mask):
    return np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 0)


def cached_logits(decoder, prompt, mask, tokens):
    """Logits at every prompt position (prefill) and after each fed token (decode), [B, T + STEPS, V]."""
    cache = decoder.init_cache(prompt.shape[0], prompt.shape[1] + tokens.shape[1])
    first, cache = decoder.prefill(cache, prompt, mask, all_logits=True)
    out = [np.asarray(first)]
    for t in range(tokens.shape[1]):
        logits, cache = decoder.step(cache, tokens[:, t])
        out.append(np.asarray(logits)[:, None])
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_matches_full_forward(name):
    cfg = CONFIGS[name]
    model = random_model(cfg, seed=7)
    decoder = Decoder(model)
    forward = jax.jit(lambda ids, m, p: model(ids, m, positions=p))
    rng = np.random.default_rng(3)
    for left_pads in [(0, 0), (5, 2)]:
        B, T = len(left_pads), 9
        prompt = rng.integers(1, cfg.vocab_size, (B, T))
        mask = np.ones((B, T), np.int32)
        for row, n in enumerate(left_pads):
            prompt[row, :n], mask[row, :n] = cfg.pad_token_id, 0
        padded = any(left_pads)
        tokens = rng.integers(1, cfg.vocab_size, (B, STEPS))
        ours, cache = cached_logits(decoder, prompt, mask if padded else None, tokens)

        full_ids = np.concatenate([prompt, tokens], axis=1)
        full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
        ref = np.asarray(forward(jnp.asarray(full_ids), jnp.asarray(full_mask) if padded else None,
                                 jnp.asarray(hf_positions(full_mask))))
        real = full_mask > 0
        err = max_rel(ours[real], ref[real])
        label = f"{name} left pads {left_pads}"
        print(f"\n[{label}] cached vs full forward over {T}+{STEPS} tokens: max-rel {err:.2e}")
        assert err <= TOL
        np.testing.assert_array_equal(np.asarray(cache.lengths), real.sum(axis=1))
        assert int(cache.index) == T + STEPS == cache.max_length
        overflow, _ = decoder.step(cache, tokens[:, 0])  # one token more than the cache holds: NaN, not garbage
        assert np.isnan(np.asarray(overflow)).all()




def test_positions_follow_hf_generate():
    """HF generate passes position_ids = cumsum(attention_mask) - 1 (pads 0) and continues from the last one.
    RoPE is shift-invariant, so the logits above cannot tell this from slot positions at 1e-5: pin it here."""
    cfg = CONFIGS["gqa2_conv22"]
    cache = init_cache(random_model(cfg, seed=0), batch=3, max_length=12)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(np.asarray(chunk_positions(cache, mask)), hf_positions(mask.astype(np.int32)))
    after_prompt = dataclasses.replace(cache, lengths=jnp.asarray(mask.sum(axis=1), jnp.int32), index=jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(chunk_positions(after_prompt, np.ones((3, 1), bool)))[:, 0], [3, 5, 1])


def test_the_decoder_holds_one_copy_of_the_weights_once_the_model_is_dropped():
    """The decoder's per-layer weights are its own arrays: with the caller's model gone, the stacked ones are freed
    (at ZAYA1-8B size a second copy would be 17 GB in bf16)."""
    import gc

    def live_bytes():
        gc.collect()
        return sum(x.nbytes for x in jax.live_arrays())

    before = live_bytes()
    model = random_model(CONFIGS["gqa2_conv22"], seed=7)
    weights = live_bytes() - before
    # the decoder's q/k/v weights are one concatenation of the four projections, and it keeps the delayed-value
    # projection as well (its bias starts the cache): that one matrix is held twice
    delayed = model.model.layers.self_attn.qkv_proj.v_proj_delayed.weight.get_value().nbytes
    decoder = Decoder(model)
    assert live_bytes() - before > 1.9 * weights  # the per-layer copy exists while the model does
    del model
    assert live_bytes() - before <= 1.01 * weights + delayed
    assert decoder.state is not None


@pytest.mark.parametrize("chunks", [(2, 3, 1, 3), (1, 1, 7)])
def test_a_prompt_fed_in_chunks_matches_the_full_forward(chunks):
    """Chunks after the first start at a nonzero slot: the CCA halo ring is read and rebuilt at every offset of the
    convolution window (prefill), and single tokens write their column into it (decode)."""
    cfg = CONFIGS["bias_conv31_sliding"]
    model = random_model(cfg, seed=11)
    decoder = Decoder(model)
    ids = np.random.default_rng(5).integers(1, cfg.vocab_size, (2, sum(chunks) + 6))
    cache = decoder.init_cache(2, ids.shape[1])
    ours, start = [], 0
    for n in chunks + (1,) * 6:
        logits, cache = decoder.prefill(cache, ids[:, start:start + n], all_logits=True)
        ours.append(np.asarray(logits))
        start += n
    ref = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids)))
    assert max_rel(np.concatenate(ours, axis=1), ref) <= TOL

"""The GPU kernel choice of the inference programs (zaya_jax/inference/kernels.py), forced on the CPU (Pallas in
interpret mode), gives what the XLA implementations give: Scorer log-probabilities, the Decoder's prefill logits
over left-padded prompts, its one-token steps over the cache and greedy generation. Each program's traced graph is
checked to contain the Pallas kernel of every impl the choice sets to 'pallas' and no other, so a kernel that cannot
take the program's shapes (cache slot positions, kv_valid) or a choice that does not reach the model fails here."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference.jax_side import max_rel, random_model

from zaya_jax.config import RopeConfig, tiny
from zaya_jax.inference import Decoder
from zaya_jax.inference.generate import generate_padded
from zaya_jax.inference.kernels import (
    GPU,
    PROGRAMS,
    XLA,
    inference_kernels,
    kernel_overrides,
    static_windows,
    with_kernels,
)
from zaya_jax.inference.scoring import Scorer, window_rows

TOL = 1e-5  # fp32 compute
# two layers: one merge fused into the next layer's norm, one into the final norm (the decoder is unrolled: each
# layer is compiled, so a third would add compile time and no new path)
CFG = tiny(dtype="float32", vocab_size=128, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=8,
           cca_time0=3, cca_time1=1, attention_bias=True, layer_types=("hybrid", "hybrid_sliding"), sliding_window=9,
           rope={"hybrid": RopeConfig(5e4, 0.5), "hybrid_sliding": RopeConfig(1e3, 0.5)})
# a name fragment of each impl's Pallas kernels (pallas_kernels/*)
KERNEL_NAMES = {"attention_impl": "attention", "moe_impl": "grouped_matmul", "norm_impl": "rms_norm",
                "conv_impl": "qk_mix"}


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=7)


def pallas_kernels(fn, *args) -> set[str]:
    """Names of the pallas_call kernels in fn's traced graph (nested jaxprs included)."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info", eqn.params.get("name"))
                names.add(str(getattr(info, "name", info)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def assert_runs_chosen_kernels(fn, program, *args):
    names = pallas_kernels(fn, *args)
    for field, impl in inference_kernels("gpu", program).items():
        found = [n for n in names if KERNEL_NAMES[field] in n]
        assert bool(found) == (impl == "pallas"), f"{program}: {field}={impl!r} but Pallas kernels {sorted(names)}"


def test_choice_per_platform_and_program(model):
    for program in PROGRAMS:
        want = dict(XLA, moe_impl="decode") if program == "decode" else XLA
        assert inference_kernels("cpu", program) == want
        assert kernel_overrides("xla", program) == want
        assert kernel_overrides("auto", program) == inference_kernels(jax.default_backend(), program)
        assert kernel_overrides(None, program) == {}
        assert set(inference_kernels("gpu", program)) == set(GPU)
    assert inference_kernels("gpu", "scoring") == GPU
    assert inference_kernels("gpu", "prefill") == GPU
    assert inference_kernels("gpu", "decode") == dict(XLA, moe_impl="decode", norm_impl="pallas", conv_impl="pallas")
    # NVIDIA scores with cuDNN's attention, unless a mix of sliding and full layers makes the window a traced value
    assert inference_kernels("cuda", "scoring") == dict(GPU, attention_impl="cudnn")
    assert inference_kernels("cuda", "scoring", static_windows=False) == inference_kernels("rocm", "scoring") == GPU
    assert inference_kernels("cuda", "prefill") == GPU
    n = model.cfg.num_hidden_layers
    mixed = model.cfg.replace(layer_types=("hybrid", "hybrid_sliding") * (n // 2), sliding_window=16)
    assert not static_windows(mixed)
    assert static_windows(mixed.replace(layer_types=("hybrid",) * n))
    assert static_windows(mixed.replace(layer_types=("hybrid_sliding",) * n))
    with pytest.raises(ValueError):
        kernel_overrides("cudnn", "scoring")
    with pytest.raises(ValueError):
        inference_kernels("gpu", "training")
    fast = with_kernels(model, "gpu", "scoring")
    assert fast.model.layers.mlp.experts.cfg.moe_impl == "pallas"
    assert fast.model.layers.self_attn.cfg.attention_impl == "pallas"
    assert model.cfg.moe_impl == "ragged" and model.model.layers.mlp.experts.cfg.moe_impl == "ragged"
    assert fast.model.embed_tokens.weight.get_value() is model.model.embed_tokens.weight.get_value()  # shared
    assert with_kernels(model, None, "decode") is model


def test_scoring_gpu_kernels_match_xla(model):
    rng = np.random.default_rng(0)
    requests = [(rng.integers(1, CFG.vocab_size, a).tolist(), rng.integers(1, CFG.vocab_size, b).tolist())
                for a, b in [(1, 7), (3, 5), (12, 9), (20, 4), (40, 6)]]  # the last is cut on the left
    kw = dict(max_length=32, batch_size=2, buckets=(16, 32))
    fast, ref = Scorer(model, kernels="gpu", **kw), Scorer(model, kernels="xla", **kw)
    arrays = window_rows([], 16, 16)
    assert_runs_chosen_kernels(fast._score, "scoring", fast.state, *[np.zeros((2,) + a.shape[1:], a.dtype)
                                                                      for a in arrays])
    got, want = fast.loglikelihood(requests), ref.loglikelihood(requests)
    for (logp, greedy), (want_logp, want_greedy) in zip(got, want):
        assert logp == pytest.approx(want_logp, rel=TOL, abs=TOL)
        assert greedy == want_greedy


def test_decoder_gpu_kernels_match_xla(model):
    rng = np.random.default_rng(1)
    B, T, steps = 3, 11, 6
    prompt = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    for row, n in enumerate((0, 4, 9)):  # left padding
        prompt[row, :n], mask[row, :n] = CFG.pad_token_id, 0
    tokens = rng.integers(1, CFG.vocab_size, (B, steps)).astype(np.int32)
    fast, ref = Decoder(model, kernels="gpu"), Decoder(model, kernels=None)  # ref: the model's own (ragged) experts
    cache = fast.init_cache(B, T + steps)
    assert_runs_chosen_kernels(lambda s, c, i, m: fast._prefill(s, c, i, m, all_logits=True), "prefill",
                               fast.state, cache, jnp.asarray(prompt), jnp.asarray(mask, bool))
    assert_runs_chosen_kernels(fast._step, "decode", fast.state, cache, jnp.asarray(tokens[:, 0]))

    def run(decoder):
        cache = decoder.init_cache(B, T + steps)
        first, cache = decoder.prefill(cache, prompt, mask, all_logits=True)
        out = [np.asarray(first)[mask > 0]]
        for t in range(steps):
            logits, cache = decoder.step(cache, tokens[:, t])
            out.append(np.asarray(logits))
        return np.concatenate(out)

    err = max_rel(run(fast), run(ref))
    print(f"\nprefill + {steps} steps, gpu kernels vs xla: max-rel {err:.2e}")
    assert err <= TOL
    gen_fast = generate_padded(fast, prompt, mask, max_new_tokens=steps)
    gen_ref = generate_padded(ref, prompt, mask, max_new_tokens=steps)
    np.testing.assert_array_equal(gen_fast.tokens, gen_ref.tokens)
    np.testing.assert_array_equal(gen_fast.lengths, gen_ref.lengths)

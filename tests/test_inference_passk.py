"""pass@k: the estimator equals the closed form 1 - C(n-c, k)/C(n, k) (exact rationals) and the brute-force
probability that a random k-subset of the n samples holds a correct one; the evaluation loop counts what the
checker accepts over samples drawn by the cached decoder."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hf_reference.jax_side import random_model

from zaya_jax.config import tiny
from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.inference import Decoder, Sampling
from zaya_jax.inference.passk import decoder_sampler, evaluate_pass_at_k, pass_at_k


def closed_form(n, c, k) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_estimator_equals_closed_form():
    for n in range(1, 31):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-12), (n, c, k)
    # large n as in best-of-64 from 200 samples: no overflow, still the closed form
    for c in (0, 1, 7, 100, 137, 200):
        assert pass_at_k(200, c, 64) == pytest.approx(float(closed_form(200, c, 64)), abs=1e-12)


def test_estimator_is_the_subset_probability():
    n = 7
    for c in range(n + 1):
        correct = set(range(c))
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            hit = sum(bool(correct.intersection(s)) for s in subsets)
            assert pass_at_k(n, c, k) == pytest.approx(hit / len(subsets), abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_estimator_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 5)


def test_pass_at_k_over_sampled_completions():
    cfg = tiny(dtype="float32", vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=2, router_hidden_size=8,
               remat="none")
    tok = ByteTokenizer()
    decoder = Decoder(random_model(cfg, seed=4))
    sampling = Sampling(temperature=1.0, top_k=40)
    problems = [{"prompt": "abc", "letter": "S"}, {"prompt": "xyz", "letter": "k"}]

    def check(problem, completion):  # 'passes' when the completion holds the problem's letter
        return problem["letter"] in completion

    def run():
        sampler = decoder_sampler(decoder, tok, max_new_tokens=24, sampling=sampling, seed=7, batch_size=8)
        return evaluate_pass_at_k(problems, prompt_of=lambda p: p["prompt"], sample=sampler, check=check, n=12,
                                  ks=(1, 4, 12))

    result = run()
    for problem, completions, c in zip(problems, result.samples, result.correct):
        assert len(completions) == 12 and len(set(completions)) > 1  # sampled, not greedy
        assert c == sum(check(problem, s) for s in completions)
    for k, value in result.pass_at.items():
        assert value == pytest.approx(np.mean([float(closed_form(12, c, k)) for c in result.correct]))
    print(f"\ncorrect per problem {result.correct}; pass@k {result.pass_at}")
    assert 0 < sum(result.correct) < 24, "pick another checker: it accepts all or nothing"
    assert run().samples == result.samples  # a seed reproduces the samples

"""pass@k with n samples per problem and a user-supplied checker.

pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]: the unbiased estimate, from n samples of which c pass, of the
chance that at least one of k samples passes (the estimator of Chen et al. 2021, "Evaluating Large Language Models
Trained on Code"). Computed as a product, so large n (e.g. best-of-64 from 200 samples) never forms huge binomials.

    sampler = decoder_sampler(Decoder(model), tokenizer, max_new_tokens=256, sampling=Sampling(temperature=0.8))
    result = evaluate_pass_at_k(problems, prompt_of=lambda p: p["prompt"], sample=sampler,
                                check=lambda p, completion: run_tests(p, completion), n=64, ks=(1, 8, 64))
    result.pass_at  # {1: ..., 8: ..., 64: ...}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.generate import generate
from zaya_jax.inference.sampling import Sampling


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for n samples, c of them correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


@dataclasses.dataclass
class PassAtK:
    pass_at: dict[int, float]  # k -> mean over problems
    correct: list[int]  # c per problem
    n: int
    samples: list[list[str]]  # the n completions per problem


def evaluate_pass_at_k(problems: Sequence[Any], *, prompt_of: Callable[[Any], str],
                       sample: Callable[[str, int], list[str]], check: Callable[[Any, str], bool], n: int,
                       ks: Sequence[int] = (1,)) -> PassAtK:
    """sample(prompt, n) -> n completions; check(problem, completion) -> passed."""
    if any(k > n for k in ks):
        raise ValueError(f"every k must be <= n={n}, got ks={list(ks)}")
    correct, samples = [], []
    for problem in problems:
        completions = sample(prompt_of(problem), n)
        if len(completions) != n:
            raise ValueError(f"sample() returned {len(completions)} completions, expected {n}")
        samples.append(completions)
        correct.append(sum(bool(check(problem, s)) for s in completions))
    pass_at = {k: float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks}
    return PassAtK(pass_at=pass_at, correct=correct, n=n, samples=samples)


def decoder_sampler(decoder: Decoder, tokenizer: Tokenizer, *, max_new_tokens: int, sampling: Sampling,
                    seed: int = 0, batch_size: int = 16, stop_tokens: Sequence[int] | None = None):
    """sample(prompt, n) that draws n completions of `prompt` with the cached decoder, batch_size rows at a time
    (every call advances one PRNG key, so repeated calls give fresh samples and a seed reproduces a run)."""
    if sampling.greedy:
        raise ValueError("pass@k needs sampling (temperature > 0): greedy samples are all the same")
    stops = list(stop_tokens) if stop_tokens is not None else [t for t in (tokenizer.eos_id,) if t is not None]
    state = {"key": jax.random.key(seed)}

    def sample(prompt: str, n: int) -> list[str]:
        ids = tokenizer.encode(prompt).tolist() or [tokenizer.bos_id if tokenizer.bos_id is not None else stops[0]]
        out = []
        while len(out) < n:
            state["key"], key = jax.random.split(state["key"])
            gen = generate(decoder, [ids] * batch_size, max_new_tokens=max_new_tokens, sampling=sampling,
                           stop_tokens=stops, key=key)
            out += [tokenizer.decode(np.asarray(gen.row(r))) for r in range(batch_size)]
        return out[:n]

    return sample

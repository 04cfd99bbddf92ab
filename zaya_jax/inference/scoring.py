"""Jit-compiled log-likelihood scoring: log p(continuation | context) for many requests, and rolling
(whole-document) log-likelihoods for perplexity, in fixed-shape buckets.

Requests are sorted by length and batched into [batch_size, bucket] arrays (bucket = the smallest configured
length that holds the longest row), right-padded: attention, both CCA convolutions and the value shift are causal,
so padding on the right changes no real position's logits and needs no mask. One compile per bucket length.

    scorer = Scorer(model, max_length=2048)
    scorer.loglikelihood([(context_ids, continuation_ids), ...])   # [(sum log p, continuation is greedy), ...]
    scorer.loglikelihood_rolling([doc_ids, ...], prefix_token=bos)  # [sum log p of every token, ...]
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.inference.kernels import with_kernels
from zaya_jax.model.zaya import ZayaForCausalLM


def default_buckets(max_length: int, smallest: int = 32) -> tuple[int, ...]:
    out, n = [], smallest
    while n < max_length:
        out.append(n)
        n *= 2
    return tuple(out) + (max_length,)


def rolling_windows(tokens: Sequence[int], max_length: int, prefix_token: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that predict every token of `tokens` exactly once, each from as much context
    as max_length inputs allow: the first window starts from `prefix_token`; later windows predict up to
    max_length new tokens, and the last one takes a full max_length of context even when it predicts fewer."""
    tokens = list(tokens)
    n = len(tokens)
    if n == 0:
        return []
    first = min(max_length, n)
    windows = [([prefix_token], tokens[:first])]
    predicted = first
    while predicted < n:
        end = min(n, predicted + max_length)
        windows.append((tokens[end - max_length - 1: predicted], tokens[predicted:end]))
        predicted = end
    return windows


_LOGIT_CHUNK = 128  # positions whose [B, chunk, vocab] fp32 logits exist at once (ZAYA1's vocab is 262k)


def _score_rows(graphdef, state, inputs, targets, weights):
    """Sum of target log-probabilities per row where weights > 0, and whether every such target is the argmax.
    Logits are formed a chunk of positions at a time, never as one [B, L, vocab] array."""
    model = nnx.merge(graphdef, state)
    y, _ = model.model(inputs)
    B, L, _ = y.shape
    chunk = np.gcd(L, _LOGIT_CHUNK)

    def per_chunk(args):
        y_c, t_c = args
        logits = model.logits(y_c)
        picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == t_c

    def split(x):
        return jnp.moveaxis(x.reshape(B, L // chunk, chunk, *x.shape[2:]), 1, 0)

    logp, greedy = jax.lax.map(per_chunk, (split(y), split(targets)))
    logp, greedy = jnp.moveaxis(logp, 0, 1).reshape(B, L), jnp.moveaxis(greedy, 0, 1).reshape(B, L)
    counted = weights > 0
    return jnp.where(counted, logp, 0.0).sum(axis=-1), jnp.where(counted, greedy, True).all(axis=-1)


class Scorer:
    def __init__(self, model: ZayaForCausalLM, *, max_length: int = 2048, batch_size: int = 8,
                 buckets: Sequence[int] | None = None, pad_id: int = 0, kernels: str | None = None):
        """kernels: None (the model's impls), 'auto', 'xla' or 'gpu' (inference/kernels.py, program 'scoring')."""
        self.max_length, self.batch_size, self.pad_id = max_length, batch_size, pad_id
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(max_length)
        if self.buckets[-1] < max_length:
            raise ValueError(f"the largest bucket {self.buckets[-1]} is shorter than max_length {max_length}")
        self.graphdef, self.state = nnx.split(with_kernels(model, kernels, "scoring"))
        self._score = jax.jit(lambda state, *rows: _score_rows(self.graphdef, state, *rows))
        self._compiled = {}  # bucket length -> compiled scoring program
        self.seconds = {"compile": 0.0, "scoring": 0.0}  # where the calls' wall time went

    def loglikelihood(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(context, continuation) token lists -> (log p(continuation | context), continuation is greedy).
        The context must be non-empty (start it with a BOS/EOS token); a long context is cut on the left to keep
        max_length inputs."""
        rows = []
        for context, continuation in requests:
            if not context:
                raise ValueError("empty context: prefix the request with a BOS/EOS token")
            if not continuation:
                raise ValueError("empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            full = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((full[:-1], full[1:], len(continuation)))
        return self._run(rows)

    def loglikelihood_rolling(self, documents: Sequence[Sequence[int]], prefix_token: int) -> list[float]:
        """Sum of log p(token | everything before it, up to max_length) over every token of each document."""
        pairs, owner = [], []
        for i, doc in enumerate(documents):
            for window in rolling_windows(doc, self.max_length, prefix_token):
                pairs.append(window)
                owner.append(i)
        totals = np.zeros(len(documents))
        for i, (logp, _) in zip(owner, self.loglikelihood(pairs)):
            totals[i] += logp
        return totals.tolist()

    def _run(self, rows) -> list[tuple[float, bool]]:
        began, compile_before = time.perf_counter(), self.seconds["compile"]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        B = self.batch_size
        for start in range(0, len(order), B):
            chunk = order[start:start + B]
            L = next(b for b in self.buckets if b >= len(rows[chunk[0]][0]))
            inputs = np.full((B, L), self.pad_id, np.int32)
            targets = np.zeros((B, L), np.int32)
            weights = np.zeros((B, L), np.float32)
            for r, i in enumerate(chunk):
                x, y, n = rows[i]
                inputs[r, :len(x)], targets[r, :len(y)] = x, y
                weights[r, len(y) - n:len(y)] = 1.0
            logp, greedy = self._program(L, inputs, targets, weights)(self.state, inputs, targets, weights)
            logp, greedy = np.asarray(logp), np.asarray(greedy)
            for r, i in enumerate(chunk):
                results[i] = (float(logp[r]), bool(greedy[r]))
        self.seconds["scoring"] += time.perf_counter() - began - (self.seconds["compile"] - compile_before)
        return results

    @property
    def compiled_lengths(self) -> tuple[int, ...]:
        return tuple(sorted(self._compiled))

    def _program(self, length: int, *rows):
        if length not in self._compiled:
            start = time.perf_counter()
            self._compiled[length] = self._score.lower(self.state, *rows).compile()
            self.seconds["compile"] += time.perf_counter() - start
        return self._compiled[length]

"""Jit-compiled log-likelihood scoring: log p(continuation | context) for many requests, and rolling
(whole-document) log-likelihoods for perplexity, in fixed-shape buckets.

Requests are sorted by length and batched into [batch_size, bucket] arrays (bucket = the smallest configured
length that holds the longest row), right-padded: attention, both CCA convolutions and the value shift are causal,
so padding on the right changes no real position's logits and needs no mask. The vocabulary head, a large share of
a forward at ZAYA1's 262k vocabulary, runs only over a window of each row's last positions that holds the scored
continuation (window lengths are buckets too). One compile per (bucket, window) pair.

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

from zaya_jax.inference.decoder import reader_state, with_fused_projections
from zaya_jax.inference.kernels import with_config, with_kernels
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


def _score_rows(graphdef, state, inputs, targets, weights, starts):
    """inputs [B, L]; targets, weights [B, C] of each row's window of positions starts[b] .. starts[b] + C - 1.
    Returns the sum of target log-probabilities per row where weights > 0, and whether every such target is the
    argmax. Logits are formed a chunk of positions at a time, never as one [B, C, vocab] array."""
    model = nnx.merge(graphdef, state)
    y, _ = model.model(inputs)
    B, C = targets.shape
    if C < y.shape[1]:
        y = jnp.take_along_axis(y, (starts[:, None] + jnp.arange(C))[..., None], axis=1)
    chunk = np.gcd(C, _LOGIT_CHUNK)

    def per_chunk(args):
        y_c, t_c = args
        logits = model.logits(y_c)
        picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == t_c

    def split(x):
        return jnp.moveaxis(x.reshape(B, C // chunk, chunk, *x.shape[2:]), 1, 0)

    logp, greedy = jax.lax.map(per_chunk, (split(y), split(targets)))
    logp, greedy = jnp.moveaxis(logp, 0, 1).reshape(B, C), jnp.moveaxis(greedy, 0, 1).reshape(B, C)
    counted = weights > 0
    return jnp.where(counted, logp, 0.0).sum(axis=-1), jnp.where(counted, greedy, True).all(axis=-1)


def window_length(length: int, scored: int) -> int:
    """The head's window for rows of `length` inputs whose longest scored continuation has `scored` tokens."""
    return next(w for w in default_buckets(length) if w >= scored)


def window_rows(rows, length: int, window: int, pad_id: int = 0):
    """[(inputs, targets, scored count)] of at most `length` tokens -> the arrays of one scoring call: inputs
    [B, length] right-padded with pad_id, and targets, weights, starts of the `window` positions that end each row's
    targets."""
    B = len(rows)
    inputs = np.full((B, length), pad_id, np.int32)
    targets = np.zeros((B, window), np.int32)
    weights = np.zeros((B, window), np.float32)
    starts = np.zeros((B,), np.int32)
    for r, (x, y, n) in enumerate(rows):
        inputs[r, :len(x)] = x
        start = min(max(len(y) - window, 0), length - window)
        starts[r] = start
        targets[r, :len(y) - start] = y[start:]
        weights[r, len(y) - start - n:len(y) - start] = 1.0
    return inputs, targets, weights, starts


class Scorer:
    def __init__(self, model: ZayaForCausalLM, *, max_length: int = 2048, batch_size: int = 8,
                 buckets: Sequence[int] | None = None, pad_id: int = 0, kernels: str | None = None,
                 state: nnx.State | None = None):
        """kernels: None (the model's impls), 'auto', 'xla' or 'gpu' (inference/kernels.py, program 'scoring').
        state: inference_state(model) (inference/decoder.py), to share one copy of the weights with other Scorers
        and Decoders of `model` (by default the scorer makes its own)."""
        self.max_length, self.batch_size, self.pad_id = max_length, batch_size, pad_id
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(max_length)
        if self.buckets[-1] < max_length:
            raise ValueError(f"the largest bucket {self.buckets[-1]} is shorter than max_length {max_length}")
        model = with_kernels(model, kernels, "scoring")
        # unrolled over per-layer weights held as their own arrays (a copy made once, as the Decoder's): a layer
        # scan copies every layer's slice of the stacked weights in each call, and the unrolled forward fuses
        # each layer's last residual merge with the next norm
        model = with_config(model, model.cfg.replace(scan_layers=False, remat="none"))
        model = with_fused_projections(model)
        self.graphdef, own = nnx.split(model)
        self.state = reader_state(own, state)
        self._score = jax.jit(lambda state, *rows: _score_rows(self.graphdef, state, *rows))
        self._compiled = {}  # (bucket length, window) -> compiled scoring program
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
        pending = []  # every batch is dispatched before any result is read: the host lays out the next batch
        for start in range(0, len(order), B):  # while the device runs this one
            chunk = [rows[i] for i in order[start:start + B]]
            L = next(b for b in self.buckets if b >= len(chunk[0][0]))
            window = window_length(L, max(n for _, _, n in chunk))
            arrays = window_rows(chunk + [([], [], 0)] * (B - len(chunk)), L, window, self.pad_id)
            pending.append((order[start:start + B], self.program(L, window)(self.state, *arrays)))
        for owners, (logp, greedy) in pending:
            logp, greedy = np.asarray(logp), np.asarray(greedy)
            for r, i in enumerate(owners):
                results[i] = (float(logp[r]), bool(greedy[r]))
        self.seconds["scoring"] += time.perf_counter() - began - (self.seconds["compile"] - compile_before)
        return results

    @property
    def compiled_lengths(self) -> tuple[int, ...]:
        return tuple(sorted({length for length, _ in self._compiled}))

    def program(self, length: int, window: int):
        """The compiled scoring program for rows of `length` inputs whose scored targets end within their last
        `window` positions (compiled on first use)."""
        if (length, window) not in self._compiled:
            start = time.perf_counter()
            arrays = window_rows([], length, window)
            B = self.batch_size
            shapes = [jax.ShapeDtypeStruct((B,) + a.shape[1:], a.dtype) for a in arrays]
            self._compiled[length, window] = self._score.lower(self.state, *shapes).compile()
            self.seconds["compile"] += time.perf_counter() - start
        return self._compiled[length, window]

"""Batched generation: left-padded prompts, a jitted prefill, then one jitted decode loop (lax.while_loop over
single-token steps with the cache donated) that stops when every row has emitted a stop token or after
max_new_tokens. As HF generate: positions continue each row's real-token count, and a row that has stopped keeps
receiving the pad token (its output is pad from then on).

    gen = generate(Decoder(model), [[2, 17, 5], [2, 9]], max_new_tokens=32, stop_tokens=[1])
    gen.tokens[i, :gen.lengths[i]]                                # row i's new tokens (stop token included)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.inference.decoder import Decoder, extend
from zaya_jax.inference.sampling import GREEDY, Sampling, choose


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [B, max_new_tokens] int32; pad after a row stopped (or after the loop ended)
    lengths: np.ndarray  # [B] new tokens per row, its stop token included
    stopped: np.ndarray  # [B] bool: the row ended on a stop token

    def row(self, i: int) -> list[int]:
        return self.tokens[i, : self.lengths[i]].tolist()


def length_bucket(n: int, smallest: int = 16) -> int:
    """The compiled length that holds n: `smallest`, then 2^k and 3 * 2^(k-1) (24, 32, 48, 64, 96, ...), so that
    prompts, caches and decode loops of nearby lengths share one compiled program while padding at most half of n."""
    if n < 1:
        raise ValueError(f"length_bucket needs a positive length, got {n}")
    bucket = smallest
    while bucket < n:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids [B, T], mask [B, T]) with T = `length` (default length_bucket of the longest prompt). Extra pads change
    nothing without attention biases (ZAYA1): they are masked keys left of every real token (sliding windows count
    slots back from the query), and their zeroed inputs give the CCA convolutions the same zero halo a sequence
    start has. With attention biases a pad's q/k projections are the biases, in HF as here, so the result then
    depends on the padding as HF's does."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    T = length_bucket(longest) if length is None else length
    if T < longest:
        raise ValueError(f"left_pad: length {T} is shorter than the longest prompt ({longest} tokens)")
    ids = np.full((len(prompts), T), pad_id, np.int32)
    mask = np.zeros((len(prompts), T), np.int32)
    for row, p in enumerate(prompts):
        ids[row, T - len(p):] = p
        mask[row, T - len(p):] = 1
    return ids, mask


def generate(decoder: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = GREEDY, stop_tokens: Sequence[int] = (), key=None,
             pad_id: int | None = None) -> Generation:
    """Prompts are left-padded to length_bucket of the longest one: generations whose prompts and max_new_tokens
    fall in the same buckets run the same compiled prefill and decode loop."""
    pad_id = _pad_id(decoder, pad_id)
    ids, mask = left_pad(prompts, pad_id)
    return generate_padded(decoder, ids, mask, max_new_tokens=max_new_tokens, sampling=sampling,
                           stop_tokens=stop_tokens, key=key, pad_id=pad_id)


def generate_padded(decoder: Decoder, input_ids, attention_mask=None, *, max_new_tokens: int,
                    sampling: Sampling = GREEDY, stop_tokens: Sequence[int] = (), key=None,
                    pad_id: int | None = None) -> Generation:
    """input_ids [B, T] left-padded, attention_mask [B, T] (1 = real token; None = no padding). The decode loop is
    compiled for length_bucket(max_new_tokens) steps and stops after max_new_tokens (a traced bound), over a cache
    of length_bucket(T + those steps) slots."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = np.asarray(input_ids, np.int32)
    mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
    if mask is not None:
        _check_left_padded(mask)
    pad_id = _pad_id(decoder, pad_id)
    B, T = ids.shape
    steps = length_bucket(max_new_tokens)
    cache = decoder.init_cache(B, length_bucket(T + steps))
    first_logits, cache = decoder.prefill(cache, ids, mask)
    stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
    key = jax.random.key(0) if key is None else key
    loop = decode_loop(decoder)
    tokens, lengths, stopped, _ = loop(decoder.state, cache, first_logits, key, stops, jnp.int32(pad_id),
                                    jnp.int32(max_new_tokens), sampling=sampling, steps=steps)
    return Generation(np.asarray(tokens)[:, :max_new_tokens], np.asarray(lengths), np.asarray(stopped))


def decode_loop(decoder: Decoder):
    """The decoder's compiled generation loop (one per decoder): loop(state, cache, first_logits, key, stops, pad_id,
    max_new_tokens, sampling=, steps=) -> (tokens [B, steps], lengths, stopped, cache); the cache is donated."""
    return decoder.bind(_decode_loop, static_argnames=("sampling", "steps"), donate_argnums=1)


def _decode_loop(graphdef, state, cache, first_logits, key, stops, pad_id, max_new_tokens, *, sampling, steps):
    """Up to max_new_tokens (traced, <= steps) tokens per row into a [B, steps] buffer."""
    model = nnx.merge(graphdef, state)
    B = first_logits.shape[0]

    def pick(logits, key, stopped):
        key, sub = jax.random.split(key)
        tok = jnp.where(stopped, pad_id, choose(logits, sub, sampling))
        return tok, key

    def record(i, tok, out, lengths, stopped):
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
        lengths = lengths + (~stopped).astype(jnp.int32)
        stopped = stopped | (tok[:, None] == stops[None]).any(axis=-1)
        return out, lengths, stopped

    out = jnp.full((B, steps), pad_id, jnp.int32)
    lengths, stopped = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
    tok, key = pick(first_logits, key, stopped)
    out, lengths, stopped = record(0, tok, out, lengths, stopped)

    def cond(carry):
        i, _, _, _, _, stopped, _ = carry
        return (i < max_new_tokens) & ~stopped.all()

    def body(carry):
        i, cache, out, last, lengths, stopped, key = carry
        logits, cache = extend(model, cache, last[:, None])
        tok, key = pick(logits[:, 0], key, stopped)
        out, lengths, stopped = record(i, tok, out, lengths, stopped)
        return i + 1, cache, out, tok, lengths, stopped, key

    carry = (jnp.int32(1), cache, out, tok, lengths, stopped, key)
    _, cache, out, _, lengths, stopped, _ = jax.lax.while_loop(cond, body, carry)
    return out, lengths, stopped, cache  # returning the cache lets its donated buffers carry the loop state


def _pad_id(decoder: Decoder, pad_id: int | None) -> int:
    pad_id = decoder.cfg.pad_token_id if pad_id is None else pad_id
    if pad_id is None:
        raise ValueError("no pad token id: the model config has none, pass pad_id")
    return int(pad_id)


def _check_left_padded(mask: np.ndarray) -> None:
    real = mask > 0
    if not real[:, -1].all():
        raise ValueError("attention_mask: every row must end with a real token (left padding, as HF generate)")
    if (np.diff(real.astype(np.int8), axis=1) < 0).any():
        raise ValueError("attention_mask: padding must be on the left only (a real token is followed by a pad)")

"""Order statistics inside a Pallas-Triton program, which has reductions but no sort: the rank-th largest of int32
keys (fp32 values mapped to keys of the same order, order_key) by a bisection of counting reductions, and the
reductions it is built from. Shared by the balancing solve's rounds and equal shares' hand-on cutoff."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import platform

F32 = jnp.float32
I32 = jnp.int32
INT_MIN = -(2 ** 31)
INT_MAX = 2 ** 31 - 1
VALUE_STEPS = 24


def order_key(x):
    """fp32 -> int32 with the same order (negative floats' magnitude bits flipped)."""
    u = jax.lax.bitcast_convert_type(x, I32)
    return jnp.where(u < 0, u ^ 0x7FFFFFFF, u)


def key_value(key):
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), F32)


NEG_INF_KEY = -0x7F800001  # order_key(-inf): the bits 0xFF800000 with the magnitude flipped


def count_at_or_above(chunks, threshold):
    """chunks: [n] int32 key blocks -> how many keys are >= threshold (the chunks' hits added first: one reduction,
    whose latency is what a pass of the search costs)."""
    return jnp.sum(sum((c >= threshold).astype(I32) for c in chunks))


def min_at_or_above(chunks, threshold):
    return functools.reduce(jnp.minimum, [jnp.min(jnp.where(c >= threshold, c, INT_MAX)) for c in chunks])


def max_below(chunks, threshold):
    return functools.reduce(jnp.maximum, [jnp.max(jnp.where(c < threshold, c, INT_MIN)) for c in chunks])


def _split(lo, hi, step):
    """A key strictly inside (lo, hi) (hi >= lo + 2): the keys' value midpoint, which halves the window's values and so,
    on router margins, about halves the keys inside it; the key midpoint where that is not inside (adjacent or
    subnormal values) or after VALUE_STEPS passes, so the search ends within VALUE_STEPS + 32 passes whatever the
    data."""
    middle = order_key(0.5 * key_value(lo) + 0.5 * key_value(hi - 1))
    halfway = jnp.right_shift(lo, 1) + jnp.right_shift(hi, 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
    return jnp.where((middle > lo) & (middle < hi) & (step < VALUE_STEPS), middle, halfway)


def largest(chunks, rank, guess=None):
    """chunks: [n] int32 key blocks, rank int32 >= 1 -> (the rank-th largest key, how many keys are >= it).

    A bisection over a window [lo, hi) that always starts and ends on keys present: lo the smallest key of the upper
    part (at least rank keys >= lo), hi one past the largest key below it. Each pass counts the keys at or above a
    split and moves lo up to the smallest key there or hi down to one past the largest key below it, until exactly
    rank keys are >= lo or one distinct key is left: the same key a sort picks. The -inf keys (invalid tokens) stay
    out of the window. guess: fp32 (low, high) values thought to hold the answer; the first pass checks them
    (at least rank keys >= low, fewer > high) and starts from the keys between them if so, from all keys if not."""
    num_finite = count_at_or_above(chunks, NEG_INF_KEY + 1)
    lo = min_at_or_above(chunks, NEG_INF_KEY + 1)
    hi = max_below(chunks, INT_MAX) + 1
    at_lo = num_finite
    searching = num_finite >= rank  # else the rank-th largest is -inf
    if guess is not None:
        low = jnp.maximum(order_key(guess[0]), NEG_INF_KEY + 1)
        high = order_key(guess[1]) + 1  # NaN guesses fail the check below
        at_low = count_at_or_above(chunks, low)
        held = (at_low >= rank) & (count_at_or_above(chunks, high) < rank)
        lo = jnp.where(held, min_at_or_above(chunks, low), lo)
        hi = jnp.where(held, max_below(chunks, high) + 1, hi)
        at_lo = jnp.where(held, at_low, at_lo)

    def more(state):
        lo, hi, at_lo, _ = state
        return searching & (at_lo != rank) & (hi - 1 != lo)

    def narrow(state):
        lo, hi, at_lo, step = state
        split = _split(lo, hi, step)
        count = count_at_or_above(chunks, split)
        up = count >= rank
        return (jnp.where(up, min_at_or_above(chunks, split), lo), jnp.where(up, hi, max_below(chunks, split) + 1),
                jnp.where(up, count, at_lo), step + 1)

    lo, _, at_lo, _ = jax.lax.while_loop(more, narrow, (lo, hi, at_lo, jnp.zeros((), I32)))
    total = sum(c.size for c in chunks)
    return jnp.where(searching, lo, NEG_INF_KEY), jnp.where(searching, at_lo, total)


def warps(chunk: int) -> int:
    """Warps for a program that reduces key chunks of `chunk`: about 8 keys per thread."""
    lanes = 64 if platform.vendor() == "rocm" else 32
    return int(min(8, max(2, chunk // (8 * lanes))))

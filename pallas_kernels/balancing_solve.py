"""The balancing solve (zaya_jax/ops/balancing_solve.py) as one Pallas kernel (Triton lowering): every round in a
single program that holds the whole [E, N] block of scores in registers.

The reference runs each round as a chain of small XLA kernels (maxima over experts, margins, a sort per expert),
so a solve costs its rounds' launches. Here each expert's k-th largest margin comes from a bitwise search over the
margins' order-preserving int32 keys (31 counting passes from the top bit down: the largest key with at least k keys
at or above it), which picks exactly the element the reference's sort picks; the (k+1)-th is that same key if it
occurs more than k times, else the largest key below it. Pallas-Triton has no sort, and a search over counts is all
reductions, which it has.

Padded experts (E is rounded up to a power of two) score -inf and keep a zero change; padded tokens are invalid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import platform
from pallas_kernels import vma

F32 = jnp.float32
I32 = jnp.int32
INT_MIN = -(2 ** 31)
MAX_SCORES = 1 << 16  # what one program holds in registers (16 x 2048 at the bench preset's solve)


def _key(x):
    """fp32 -> int32 with the same order (negative floats' magnitude bits flipped)."""
    u = jax.lax.bitcast_convert_type(x, I32)
    return jnp.where(u < 0, u ^ 0x7FFFFFFF, u)


def _value(key):
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), F32)


def _count(mask):
    return jnp.sum(mask.astype(I32), axis=1)


def _largest(key, rank):
    """key [E, N] int32, rank int32 -> [E] each row's rank-th largest key (rank >= 1)."""
    cand = jnp.where(_count(key >= 0) >= rank, 0, INT_MIN).astype(I32)

    def bit(i, cand):
        trial = cand | jnp.left_shift(jnp.int32(1), 30 - i)
        return jnp.where(_count(key >= trial[:, None]) >= rank, trial, cand)

    return jax.lax.fori_loop(0, 31, bit, cand)


def _kernel(scores_ref, valid_ref, out_ref, *, num_experts, num_tokens, rounds, damping, momentum):
    scores = scores_ref[...]
    valid = (valid_ref[...] != 0)[None, :]
    padded_experts = scores.shape[0]
    rows = jnp.arange(padded_experts)
    real = rows < num_experts
    count = jnp.sum(valid.astype(I32))
    k = jnp.clip(jax.lax.div(count, num_experts), 1, num_tokens - 1)
    # the median valid score: the ((count - 1) // 2)-th smallest is the (count - (count - 1) // 2)-th largest
    median = _value(_largest(_key(jnp.where(valid, scores, -jnp.inf)),
                             jnp.maximum(count - jax.lax.div(count - 1, 2), 1)))
    median = jnp.where(real, median, 0.0)
    start = jnp.where(real, jnp.sum(median) / num_experts - median, 0.0)

    def round_(_, carry):
        delta, change = carry
        s = scores + delta[:, None]
        first = jnp.max(s, axis=0)
        leader = jnp.min(jnp.where(s == first[None, :], rows[:, None], padded_experts), axis=0)
        is_first = rows[:, None] == leader[None, :]
        second = jnp.max(jnp.where(is_first, -jnp.inf, s), axis=0)
        margin = jnp.where(valid, s - jnp.where(is_first, second[None, :], first[None, :]), -jnp.inf)
        key = _key(margin)
        kth = _largest(key, k)
        below = jnp.max(jnp.where(key < kth[:, None], key, INT_MIN), axis=1)
        next_ = jnp.where(_count(key >= kth[:, None]) > k, kth, below)
        middle = 0.5 * (_value(kth) + _value(next_))
        step = jnp.where(real & (jnp.abs(middle) < jnp.inf), middle, 0.0)  # NaN and -inf: no step
        change = momentum * change - damping * step
        change = jnp.where(real, change - jnp.sum(change) / num_experts, 0.0)
        return delta + change, change

    delta, _ = jax.lax.fori_loop(0, rounds, round_, (start, jnp.zeros_like(start)))
    out_ref[...] = delta


def _warps(scores: int) -> int:
    """About 64 scores per thread (one fp32 block and its int32 keys fit in registers beside the rest)."""
    lanes = 64 if platform.vendor() == "rocm" else 32
    return int(min(16, max(4, scores // (64 * lanes))))


def solve(scores, valid, *, rounds: int, damping: float, momentum: float, num_warps: int | None = None):
    """scores [E, N] fp32, valid [N] bool -> the zero-mean bias change [E]; the reference's numerics."""
    num_experts, num_tokens = scores.shape
    pe, pn = pl.next_power_of_2(num_experts), pl.next_power_of_2(num_tokens)
    if pe * pn > MAX_SCORES:
        raise ValueError(f"balancing solve kernel: [{num_experts}, {num_tokens}] scores exceed the {MAX_SCORES} one "
                         "program holds; solve on a subset of the tokens (model/routing_stats.py: SOLVE_TOKENS)")
    scores = jnp.pad(jax.lax.stop_gradient(scores).astype(F32), ((0, 0), (0, pn - num_tokens)))
    scores = jnp.pad(scores, ((0, pe - num_experts), (0, 0)), constant_values=-jnp.inf)
    valid = jnp.pad(valid.astype(I32), (0, pn - num_tokens))
    scores, valid = vma.vary_to_union(scores, valid)
    kernel = functools.partial(_kernel, num_experts=num_experts, num_tokens=num_tokens, rounds=int(rounds),
                               damping=float(damping), momentum=float(momentum))
    delta = pl.pallas_call(
        kernel, out_shape=vma.out_struct((pe,), F32, scores),
        compiler_params=platform.compiler_params(num_warps or _warps(pe * pn), 1),
        interpret=platform.interpret())(scores, valid)
    return delta[:num_experts]

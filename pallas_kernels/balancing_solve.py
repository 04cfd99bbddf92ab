"""The balancing solve's rounds (zaya_jax/ops/balancing_solve.py) as Pallas kernels (Triton lowering): one launch
per round, one program per expert.

The reference runs each round as a chain of small XLA kernels around a sort of every expert's margins, so a round
costs several launches and a sort. Here one program per expert recomputes every token's best and second-best score (a
few reads of the [E, N] block, shared by the experts through the cache), forms its own expert's margins and finds the
k-th and (k+1)-th largest by a search over the margins' order-preserving int32 keys (_order_search.largest: a
bisection guided by their values, all reductions, which Pallas-Triton has; it has no sort). It picks exactly the
elements the reference's sort picks.

The rounds' shared state (every expert's bias change, its momentum, the previous round's midpoints and k-th largest
margins, from which the next search starts) is updated at the start of the next round's launch, identically in every
program; program 0 writes it back. Padded experts (E is rounded up to a power of two) score -inf; padded tokens are
invalid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _order_search as search
from pallas_kernels import platform
from pallas_kernels import vma

F32 = jnp.float32
I32 = jnp.int32
CHUNK = 2048
_warps = search.warps  # a name the benchmarks can replace
MAX_SCORES = 1 << 16  # the [E, N] block one program reads whole (16 x 2048 at the bench preset's solve)


def _kth_and_next(chunks, k, guess=None):
    """The k-th and (k+1)-th largest of the keys (k in [1, count - 1])."""
    kth, ties = search.largest(chunks, k, guess)
    return kth, jnp.where(ties > k, kth, search.max_below(chunks, kth))


def _pick(vector, index):
    """vector [C] -> vector[index] for a traced index (a masked sum: Triton cannot index registers)."""
    return jnp.sum(jnp.where(jnp.arange(vector.shape[0]) == index, vector, jnp.zeros_like(vector)))


def next_change(delta, change, middle, num_experts: int, damping: float, momentum: float):
    """One round's update of the [E'] state from its midpoints (E' >= num_experts; the padded experts stay 0): the
    reference's arithmetic (ops/balancing_solve.py), written for registers as well as for XLA."""
    real = jnp.arange(delta.shape[0]) < num_experts
    step = jnp.where(real & (jnp.abs(middle) < jnp.inf), middle, 0.0)  # NaN and -inf: no step
    change = momentum * change - damping * step
    change = jnp.where(real, change - jnp.sum(jnp.where(real, change, 0.0)) / num_experts, 0.0)
    return delta + change, change


def _chunks(num_tokens: int):
    """Static token slices of at most CHUNK: one [E, CHUNK] block of scores in registers at a time."""
    return [pl.ds(start, min(CHUNK, num_tokens - start)) for start in range(0, num_tokens, CHUNK)]


def _median_kernel(scores_ref, valid_ref, median_ref):
    e = pl.program_id(0)
    keys, count = [], 0
    for part in _chunks(scores_ref.shape[1]):
        valid = valid_ref[part] != 0
        count = count + jnp.sum(valid.astype(I32))
        keys.append(search.order_key(jnp.where(valid, scores_ref[pl.ds(e, 1), part][0], -jnp.inf)))
    # the ((count - 1) // 2)-th smallest valid score is the (count - (count - 1) // 2)-th largest
    rank = jnp.maximum(count - jax.lax.div(count - 1, 2), 1)
    median_ref[...] = jnp.full((1,), search.key_value(search.largest(keys, rank)[0]), F32)


def _round_kernel(scores_ref, valid_ref, delta_ref, change_ref, middle_ref, kth_ref, delta_out, change_out, middle_out,
                  kth_out, *, num_experts, num_tokens, damping, momentum):
    e = pl.program_id(0)
    padded = scores_ref.shape[0]
    rows = jnp.arange(padded)
    real = rows < num_experts
    # the previous round's step, as the reference takes it after its sort
    delta, change = next_change(delta_ref[...], change_ref[...], middle_ref[...], num_experts, damping, momentum)

    @pl.when(e == 0)
    def _():
        delta_out[...] = delta
        change_out[...] = change

    mine = _pick(delta, e)
    keys, count, largest = [], 0, 0.0
    for part in _chunks(scores_ref.shape[1]):
        valid = valid_ref[part] != 0
        count = count + jnp.sum(valid.astype(I32))
        s = scores_ref[:, part] + delta[:, None]
        largest = jnp.maximum(largest, jnp.max(jnp.where(real[:, None] & valid[None, :], jnp.abs(s), 0.0)))
        first = jnp.max(s, axis=0)
        leader = jnp.min(jnp.where(s == first[None, :], rows[:, None], padded), axis=0)
        second = jnp.max(jnp.where(rows[:, None] == leader[None, :], -jnp.inf, s), axis=0)
        own = scores_ref[pl.ds(e, 1), part][0] + mine
        keys.append(search.order_key(jnp.where(valid, own - jnp.where(leader == e, second, first), -jnp.inf)))
    k = jnp.clip(jax.lax.div(count, num_experts), 1, num_tokens - 1)
    # A token's margin for e is its score for e less its best other score, so this round's change moves every margin
    # by change[e] less some other expert's change: the k-th largest moves by as much, give or take a few roundings
    # of the scores' magnitude. From that window the search takes a few passes instead of ~15 (docs/routing.md).
    previous = _pick(kth_ref[...], e)
    most = jnp.max(jnp.where(real, change, -jnp.inf))
    least = jnp.min(jnp.where(real, change, jnp.inf))
    slack = largest * 2.0 ** -21
    own_change = _pick(change, e)
    guess = (previous + (own_change - most) - slack, previous + (own_change - least) + slack)
    kth, next_ = _kth_and_next(keys, k, guess)
    middle_out[...] = jnp.full((1,), 0.5 * (search.key_value(kth) + search.key_value(next_)), F32)
    kth_out[...] = jnp.full((1,), search.key_value(kth), F32)


def _padded(scores, valid):
    num_experts, num_tokens = scores.shape
    pe, pn = pl.next_power_of_2(num_experts), pl.next_power_of_2(num_tokens)
    if pe * pn > MAX_SCORES:
        raise ValueError(f"balancing solve kernel: [{num_experts}, {num_tokens}] scores exceed the {MAX_SCORES} a "
                         "program reads; solve on a subset of the tokens (model/routing_stats.py: SOLVE_TOKENS)")
    scores = jnp.pad(jax.lax.stop_gradient(scores).astype(F32), ((0, 0), (0, pn - num_tokens)))
    scores = jnp.pad(scores, ((0, pe - num_experts), (0, 0)), constant_values=-jnp.inf)
    return vma.vary_to_union(scores, jnp.pad(valid.astype(I32), (0, pn - num_tokens)))


def solve(scores, valid, *, rounds: int, damping: float, momentum: float, start: str = "median"):
    """scores [E, N] fp32, valid [N] bool -> the zero-mean bias change [E]; the reference's numerics (its `start`)."""
    num_experts, num_tokens = scores.shape
    scores, valid = _padded(scores, valid)
    pe, pn = scores.shape
    grid = (num_experts,)
    params = platform.compiler_params(_warps(min(pn, CHUNK)), 1)
    one = pl.BlockSpec((1,), lambda e: (e,))
    real = jnp.arange(pe) < num_experts
    if start == "median":
        median = pl.pallas_call(_median_kernel, grid=grid, out_specs=one,
                                out_shape=vma.out_struct((pe,), F32, scores), compiler_params=params,
                                interpret=platform.interpret())(scores, valid)
        median = jnp.where(real, median, 0.0)
        first = jnp.where(real, jnp.sum(median) / num_experts - median, 0.0)
    else:  # zeros that vary like the scores inside shard_map
        first = vma.vary(jnp.zeros(pe, F32), vma.varying_axes(scores))
    kernel = functools.partial(_round_kernel, num_experts=num_experts, num_tokens=num_tokens,
                               damping=float(damping), momentum=float(momentum))
    vector = vma.out_struct((pe,), F32, scores)
    whole = pl.BlockSpec((pe,), lambda e: (0,))
    round_ = pl.pallas_call(kernel, grid=grid, out_specs=(whole, whole, one, one),
                            out_shape=(vector, vector, vector, vector), compiler_params=params,
                            interpret=platform.interpret())
    # (delta, change, midpoints, each expert's k-th largest margin: none known before the first round)
    state = (first, jnp.zeros_like(first), jnp.zeros_like(first), jnp.full_like(first, jnp.nan))
    for _ in range(int(rounds)):
        state = round_(scores, valid, *state)
    delta, _ = next_change(*state[:3], num_experts, damping, momentum)
    return delta[:num_experts]

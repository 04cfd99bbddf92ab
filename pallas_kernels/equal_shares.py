"""Equal expert shares (zaya_jax/ops/equal_shares.py) as Pallas kernels (Triton lowering): one launch that hands on
the tokens of the experts over their share, one per refill round, one that fills the rest, in place of the
reference's chain of sorts, scatters and cumsums.

Every step of the reference is "each group keeps its `quota` tokens of the highest priority, ties in token order":
an over-full expert keeps its tokens of the largest margin, a target expert takes its bidders of the highest score.
One program per expert holds its group's priorities as order-preserving int32 keys (the other tokens at INT_MIN),
finds the quota-th largest by a most-significant-digit-first radix search (each pass counts the keys at or above 16
candidates at once, 8 passes for 32 bits: all reductions, which Pallas-Triton has; it has no sort), and keeps the
keys above it plus the first ties in token order (a cumsum). The programs of a launch write disjoint tokens (each
token is in one group) into a copy of the state they read, so no program sees another's writes.

The state between launches is one int32 per token: its expert, E for the skip class, MOVING while it is handed on.
Every program recomputes the shares and the room left from it (counts over the tokens: a few reductions). Experts
are padded to a power of two (their scores -inf, their share 0), tokens likewise (routed to the skip class).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform
from pallas_kernels import vma
from pallas_kernels.balancing_solve import INT_MIN, NEG_INF_KEY, _key, _pick

I32 = jnp.int32
MOVING = -1
CHUNK = 1024  # tokens per block in registers: [CHUNK, 16 candidates or experts] at a time
DIGIT_BITS = 4


def _parts(num_tokens: int):
    return [pl.ds(start, min(CHUNK, num_tokens - start)) for start in range(0, num_tokens, CHUNK)]


def _total(blocks):
    """Equal-shape int32 blocks added elementwise, so that a count over all the tokens is one reduction (each
    reduction's synchronisation across warps, not the arithmetic, is what a pass costs)."""
    return functools.reduce(jnp.add, [b.astype(I32) for b in blocks])


def _count(blocks) -> jax.Array:
    return jnp.sum(_total(blocks))


def _counts(ref, experts):
    """[E'] tokens of ref [N'] int32 at each value of experts."""
    return jnp.sum(_total([ref[part][:, None] == experts[None, :] for part in _parts(ref.shape[0])]), axis=0)


def _shares(counts, experts, num_experts: int):
    """The reference's shares: floor(M / E), one more for the M mod E experts holding the most (ties by id)."""
    real = experts < num_experts
    counts = jnp.where(real, counts, 0)
    total = jnp.sum(counts)
    other, me = counts[None, :], counts[:, None]
    ahead = ((other > me) | ((other == me) & (experts[None, :] < experts[:, None]))) & real[None, :]
    extra = (jnp.sum(ahead.astype(I32), axis=1) < jax.lax.rem(total, num_experts)).astype(I32)
    return jnp.where(real, jax.lax.div(total, num_experts) + extra, 0)


def _largest(keys, rank):
    """keys: equal-shape int32 blocks, rank >= 0 -> the largest key k with at least `rank` keys >= k (the rank-th
    largest for rank >= 1, INT_MAX for 0). Most significant digit first: the answer's offset from INT_MIN is built
    one 4-bit digit per pass (int32 arithmetic wraps, which is what the first digit's offsets need)."""
    prefix = jnp.full((), INT_MIN, I32)
    digits = jnp.arange(1 << DIGIT_BITS, dtype=I32)
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        candidates = prefix + jax.lax.shift_left(digits, jnp.full(digits.shape, shift, I32))
        at_or_above = jnp.sum(_total([block[:, None] >= candidates[None, :] for block in keys]), axis=0)
        # candidate 0 always holds `rank` keys (the invariant), so the digit is the number of others that do
        digit = jnp.sum((at_or_above >= rank).astype(I32)) - 1
        prefix = prefix + jax.lax.shift_left(digit, jnp.full((), shift, I32))
    return prefix


def _write_first(ref, keys, quota, value, *, chosen: bool):
    """keys: int32 blocks of ref's tokens (INT_MIN: not in the group). Writes `value` at the group's `quota` keys of
    the highest priority, ties in token order (chosen=True; all of the group when it holds no more than quota), or
    at the group's other keys (chosen=False)."""
    parts = _parts(ref.shape[0])
    rank = jnp.minimum(quota, _count([block > INT_MIN for block in keys]))
    threshold = _largest(keys, rank)
    ties_left = rank - _count([block > threshold for block in keys])

    def write(picked):
        for part, block, p in zip(parts, keys, picked):
            plgpu.store(ref.at[part], jnp.full(block.shape, value, I32), mask=p if chosen else (block > INT_MIN) & ~p)

    # usually every key at the threshold is taken; only a tie across it needs the token order (a cumsum)
    all_ties = _count([block == threshold for block in keys]) == ties_left

    @pl.when(all_ties)
    def _():
        write([block >= threshold for block in keys])

    @pl.when(~all_ties)
    def _():
        picked, before = [], jnp.zeros((), I32)
        for block in keys:
            tie = (block == threshold).astype(I32)
            order = before + jnp.cumsum(tie) - tie
            before = before + jnp.sum(tie)
            picked.append((block > threshold) | ((tie != 0) & (order < ties_left)))
        write(picked)


def _keep_kernel(scores_ref, valid_ref, index_ref, aliased_ref, state_ref, *, num_experts):
    """Program e: expert e over its share marks its tokens beyond the share's largest margins MOVING."""
    e = pl.program_id(0)
    experts = jnp.arange(scores_ref.shape[1], dtype=I32)
    counts = _counts(index_ref, experts)
    share = _pick(_shares(counts, experts, num_experts), e)

    @pl.when(_pick(counts, e) > share)
    def _():
        keys = []
        for part in _parts(index_ref.shape[0]):
            s, mine = scores_ref[part, :], experts[None, :] == e
            own = jnp.max(jnp.where(mine, s, -jnp.inf), axis=1)  # exactly s[:, e]
            margin = jnp.where(valid_ref[part] != 0, _key(own - jnp.max(jnp.where(mine, -jnp.inf, s), axis=1)),
                               NEG_INF_KEY)
            keys.append(jnp.where(index_ref[part] == e, margin, INT_MIN))
        _write_first(state_ref, keys, share, MOVING, chosen=False)


def _bid_kernel(scores_ref, valid_ref, index_ref, state_ref, aliased_ref, new_state_ref, *, num_experts):
    """Program t: every MOVING token bids for its best expert with room; expert t takes its `room` bidders of the
    highest score."""
    t = pl.program_id(0)
    experts = jnp.arange(scores_ref.shape[1], dtype=I32)
    share = _shares(_counts(index_ref, experts), experts, num_experts)
    room = jnp.where(experts < num_experts, share - _counts(state_ref, experts), 0)
    keys = []
    for part in _parts(index_ref.shape[0]):
        s = scores_ref[part, :]
        open_ = jnp.where(room[None, :] > 0, s, -jnp.inf)
        best = jnp.max(open_, axis=1)
        target = jnp.min(jnp.where(open_ == best[:, None], experts[None, :], experts.shape[0]), axis=1)
        score = jnp.max(jnp.where(experts[None, :] == target[:, None], s, -jnp.inf), axis=1)  # exactly s[target]
        priority = jnp.where(valid_ref[part] != 0, _key(score), NEG_INF_KEY)
        keys.append(jnp.where((state_ref[part] == MOVING) & (target == t), priority, INT_MIN))

    @pl.when(_count([block > INT_MIN for block in keys]) > 0)
    def _():
        _write_first(new_state_ref, keys, _pick(room, t), t, chosen=True)


def _fill_kernel(index_ref, state_ref, index_out, moved_out, *, num_experts, padded_experts):
    """One program: the k-th token still MOVING, in token order, goes to the expert whose room (counted from expert
    0) holds slot k."""
    parts = _parts(index_ref.shape[0])
    experts = jnp.arange(padded_experts, dtype=I32)
    real = experts < num_experts

    def write(filled):
        for part, new in zip(parts, filled):
            index = index_ref[part]
            routed = index < num_experts
            index_out[part] = jnp.where(routed, new, index)
            moved_out[part] = (routed & (new != index)).astype(I32)

    left = _count([state_ref[part] == MOVING for part in parts])

    @pl.when(left == 0)
    def _():
        write([state_ref[part] for part in parts])

    @pl.when(left > 0)
    def _():
        room = jnp.where(real, _shares(_counts(index_ref, experts), experts, num_experts)
                         - _counts(state_ref, experts), 0)
        room_through = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], room[None, :], 0), axis=1)
        filled, before = [], jnp.zeros((), I32)
        for part in parts:
            state = state_ref[part]
            moving = (state == MOVING).astype(I32)
            slot = before + jnp.cumsum(moving) - 1
            before = before + jnp.sum(moving)
            fill = jnp.sum(((room_through[None, :] <= slot[:, None]) & real[None, :]).astype(I32), axis=1)
            filled.append(jnp.where(moving != 0, fill, state))
        write(filled)


def _warps() -> int:
    return 4 if platform.vendor() == "rocm" else 8  # 256 threads: 4 keys of a CHUNK each


def padded_inputs(scores, index, valid):
    """The kernels' operands: scores [N', E'] fp32 (experts padded with -inf), valid [N'] int32, index [N'] int32
    (padded tokens in the skip class E)."""
    num_tokens, num_experts = scores.shape
    pe, pn = pl.next_power_of_2(num_experts), pl.next_power_of_2(num_tokens)
    scores = jnp.pad(jax.lax.stop_gradient(scores).astype(jnp.float32), ((0, pn - num_tokens), (0, 0)))
    scores = jnp.pad(scores, ((0, 0), (0, pe - num_experts)), constant_values=-jnp.inf)
    index = jnp.pad(index.astype(I32), (0, pn - num_tokens), constant_values=num_experts)
    valid = jnp.pad(valid.astype(I32), (0, pn - num_tokens))
    return vma.vary_to_union(scores, valid, index)


def launches(num_experts: int, scores):
    """(keep, bid, fill) for padded scores [N', E']: keep(scores, valid, index, index) -> state;
    bid(scores, valid, index, state, state) -> state; fill(index, state) -> (index, moved as int32). The last
    operand of keep and bid is written in place (aliased); the programs read the one before it, which stays as it
    was."""
    pn, pe = scores.shape
    state = vma.out_struct((pn,), I32, scores)
    params = platform.compiler_params(_warps(), 1)
    call = functools.partial(pl.pallas_call, grid=(num_experts,), out_shape=state, interpret=platform.interpret(),
                             compiler_params=params)
    keep = call(functools.partial(_keep_kernel, num_experts=num_experts), input_output_aliases={3: 0})
    bid = call(functools.partial(_bid_kernel, num_experts=num_experts), input_output_aliases={4: 0})
    fill = pl.pallas_call(functools.partial(_fill_kernel, num_experts=num_experts, padded_experts=pe), grid=(1,),
                          out_shape=(state, state), interpret=platform.interpret(), compiler_params=params)
    return keep, bid, fill


def equal_shares(scores, index, valid, *, refill_rounds: int):
    """scores [N, E] fp32, index [N] int32 in [0, E], valid [N] bool -> (index [N] int32, moved [N] bool): the
    reference's assignment exactly."""
    num_tokens, num_experts = scores.shape
    scores, valid, index = padded_inputs(scores, index, valid)
    keep, bid, fill = launches(num_experts, scores)
    state = keep(scores, valid, index, index)
    for _ in range(int(refill_rounds)):
        state = bid(scores, valid, index, state, state)
    new, moved = fill(index, state)
    return new[:num_tokens], moved[:num_tokens] != 0

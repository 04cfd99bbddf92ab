"""Flash-attention kernels for grouped-query attention (Pallas, Triton lowering): forward, dq, dk/dv, and a
dk/dv kernel that also writes dS tiles for a dq kernel that then
needs one matmul per tile instead of three.

Layouts: q/o/dq [B, Tp, H, dp], k/v/dk/dv [B, Sp, KV, dp], lse/delta [B, H, Tp] fp32, positions/segments
[B, Tp] / [B, Sp] int32, the sliding window a [1] int32 array (or None; an array so that scanned layers may
carry different windows), loop ranges [B, n_blocks, 4] int32 (see `_attention_blocks`). Tp, Sp are multiples of
every block size and dp is a power of two >= 16; the wrapper pads. Query head h reads KV head h // groups through
the BlockSpec index map, so repeated K/V are never materialised. Inside shard_map (check_vma) each launch makes its
inputs vary over the union of their mesh axes and its outputs carry that type (`vma`); the caller sums gradients
back to their primals' types.

Head stacking (dk/dv and the dq-from-dS-tiles kernel): a tile of query rows may hold `heads` query heads of one KV
head at the same positions, stacked position-major ([block_q, heads, dp] -> [block_q * heads, dp]). All of them
share every K/V tile, so one program does the work of `heads` programs with the same K/V loads, and the causal loop
ranges (which depend on positions only) stay those of block_q positions: a 128-row tile of 32 positions x 4 heads
wastes a quarter of the diagonal work of a 128-position tile. It widens the query side of every dk/dv matmul from
block_q to block_q * heads. The forward and dq kernels take one query head per tile (stacking measured slower
there, docs/experiments.md).

Logits are kept in base 2: s2 = (q . k) * scale * log2(e), so the softmax uses exp2 and the saved statistic is
lse2 = log2(sum 2^s2). Masked logits are NEG; a row that sees no key gets lse2 = DEAD_LSE and a zero output, so
every exp2(s2 - lse2) of the backward is 0 for it. Unmasked steps scale the raw dot inside the exponent's
argument (one fused multiply-add per logit) and only the row maxima separately.

Forward softmax shift: softmax(s) = 2^(s - m) / sum 2^(s - m) for any m, and m only has to keep the terms from
overflowing or all underflowing. The 'online' loop carries the running row maximum (one max reduction per tile and
a rescale of the accumulator whenever it grows). The 'bound' loop takes m = |q| * max_s |k_s| * scale * log2(e),
which no logit of the row exceeds (Cauchy-Schwarz), so it needs neither; it is used for a program's tile when
every row's bound is <= BOUND_SHIFT_MAX (CCA's L2-normalised queries and keys keep it near sqrt(d) * |temp| *
log2(e)), otherwise that tile takes the online loop.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform
from pallas_kernels import vma

F32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1.0e30
DEAD_LSE = 1.0e30
# The 'bound' forward shifts a row's base-2 logits by their bound b = |q| * max|k| * scale * log2(e) where b <= this:
# the row's largest term is then >= 2^-2b >= 2^-96, and terms flushed below fp32's 2^-126 are < 2^-30 of it.
BOUND_SHIFT_MAX = 48.0


def stacked_heads(groups: int, requested: int) -> int:
    """Query heads per tile: the largest power of two <= requested that divides the heads sharing a KV head
    (Triton tiles have power-of-two sides)."""
    heads = 1
    while heads * 2 <= max(1, requested) and groups % (heads * 2) == 0:
        heads *= 2
    return heads


def _visible(q_pos, kv_pos, q_seg, kv_seg, window):
    ok = kv_pos <= q_pos
    if window is not None:
        ok = ok & ((q_pos - kv_pos) < window)
    if q_seg is not None:
        ok = ok & (q_seg == kv_seg)
    return ok


def _three_loops(rng_ref, run, carry):
    """run(lo, hi, carry, masked) over [lo, u0) masked, [u0, u1) unmasked, [u1, hi) masked."""
    lo, u0, u1, hi = rng_ref[0], rng_ref[1], rng_ref[2], rng_ref[3]
    carry = run(lo, u0, carry, True)
    carry = run(u0, u1, carry, False)
    return run(u1, hi, carry, True)


def _optional_refs(rest, has_seg, has_window, n_out):
    """Splits (segments?, window?, outputs) off the tail of a kernel's refs; the window is a [1] int32 ref."""
    rest = list(rest)
    qs_ref, ks_ref = (rest.pop(0), rest.pop(0)) if has_seg else (None, None)
    window = rest.pop(0)[0] if has_window else None
    assert len(rest) == n_out
    return qs_ref, ks_ref, window, rest


def _optional_inputs(q_spec, kv_spec, q_seg, kv_seg, window):
    """(specs, arrays) of the optional segment ids and window inputs."""
    specs, arrays = [], []
    if q_seg is not None:
        specs += [q_spec, kv_spec]
        arrays += [q_seg, kv_seg]
    if window is not None:
        specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        arrays.append(window)
    return specs, arrays


def _query_grid_specs(B, Tp, Sp, H, KV, dp, bq):
    """BlockSpecs of the (query head, batch, query block) grid of the forward and dq kernels: query-side tiles,
    whole-sequence K/V of the query head's KV head, row statistics, position vectors and loop ranges. The
    heaviest (last) query blocks launch first (grid axis 2 is the slowest): a shorter tail under causal
    imbalance."""
    nq, groups = Tp // bq, H // KV

    def qi(i):
        return nq - 1 - i

    return dict(
        q=pl.BlockSpec((None, bq, None, dp), lambda h, b, i: (b, qi(i), h, 0)),
        kv=pl.BlockSpec((None, Sp, None, dp), lambda h, b, i: (b, 0, lax.div(h, groups), 0)),
        stats=pl.BlockSpec((None, None, bq), lambda h, b, i: (b, h, qi(i))),
        q_vec=pl.BlockSpec((None, bq), lambda h, b, i: (b, qi(i))),
        kv_vec=pl.BlockSpec((None, Sp), lambda h, b, i: (b, 0)),
        ranges=pl.BlockSpec((None, None, 4), lambda h, b, i: (b, qi(i), 0)),
    )


# ------------------------------------------------------------------------------------------------------ forward
def key_norm_bound(k, scale: float):
    """[B, KV] fp32: scale * log2(e) * the largest key norm of each KV head. A query row's logits s2 (base 2) then
    satisfy |s2| <= |q| * this (Cauchy-Schwarz): the shift of the forward's 'bound' softmax."""
    kf = k.astype(F32)
    return jnp.sqrt(jnp.max(jnp.sum(kf * kf, axis=-1), axis=1)) * (scale * LOG2E)


def _fwd_kernel(rng_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest, c, block_k, has_seg, has_window, mode,
                kv_heads, groups):
    """mode 'online': every tile with the running maximum. 'bound': tiles whose rows' bounds are all <= BOUND_SHIFT_MAX
    with the bound shift; the others get lse NaN (and o 0). 'fallback': o and lse come in aliased to the outputs,
    and only tiles whose lse is NaN are computed (online) and stored. One loop kind per kernel: with both in one
    kernel, in an if/else or in two ifs in a row, Triton kept both loops' pipeline buffers (428 KB of shared memory
    at 128 x 128 tiles with 3 stages, against the H200's 227 KB)."""
    if mode == "bound":
        kbound_ref, rest = rest[0], rest[1:]
    elif mode == "fallback":  # the first launch's outputs (aliased to this one's)
        lse_in_ref, rest = rest[1], rest[2:]
    qs_ref, ks_ref, window, (o_ref, lse_ref) = _optional_refs(rest, has_seg, has_window, 2)
    q_pos = qp_ref[...][:, None]
    q_seg = qs_ref[...][:, None] if has_seg else None

    def run(q, shift, lo, hi, carry, masked):
        def step(j, carry):
            acc, m, l = carry
            start = pl.multiple_of(j * block_k, block_k)
            qk = plgpu.dot(q, k_ref[pl.ds(start, block_k), :], trans_b=True)
            if masked:
                kv_seg = ks_ref[pl.ds(start, block_k)][None, :] if has_seg else None
                ok = _visible(q_pos, kp_ref[pl.ds(start, block_k)][None, :], q_seg, kv_seg, window)
            if shift is not None:  # bound: no running maximum, no rescaling
                s = qk * c - shift[:, None]
                p = jnp.exp2(jnp.where(ok, s, NEG) if masked else s)
            else:
                if masked:
                    s = jnp.where(ok, qk * c, NEG)
                    m_new = jnp.maximum(m, jnp.max(s, axis=1))
                    p = jnp.exp2(s - m_new[:, None])
                else:  # the row maxima scaled separately: one fused multiply-add per logit
                    m_new = jnp.maximum(m, jnp.max(qk, axis=1) * c)
                    p = jnp.exp2(qk * c - m_new[:, None])
                alpha = jnp.exp2(m - m_new)
                acc, m, l = acc * alpha[:, None], m_new, l * alpha
            v = v_ref[pl.ds(start, block_k), :]
            return acc + plgpu.dot(p.astype(v.dtype), v), m, l + jnp.sum(p, axis=1)
        return lax.fori_loop(lo, hi, step, carry)

    def attend(q, shift=None):
        """-> (o, lse) of the tile; shift: the rows' bounds (the bound loop) or None (online)."""
        rows, dp = q.shape
        init = (jnp.zeros((rows, dp), F32), jnp.full((rows,), NEG, F32), jnp.zeros((rows,), F32))
        acc, m, l = _three_loops(rng_ref, functools.partial(run, q, shift), init)
        if shift is None:
            live = m > 0.5 * NEG  # a row that saw no key keeps m = NEG (and its l counts the masked terms as 1)
        else:
            live, m = l > 0.0, shift  # every visible key adds >= 2^-(2 * BOUND_SHIFT_MAX) to l
        return jnp.where(live[:, None], acc / l[:, None], 0.0), jnp.where(live, m + jnp.log2(l), DEAD_LSE)

    def store(o, lse):
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse

    if mode == "online":
        store(*attend(q_ref[...]))
    elif mode == "bound":
        q = q_ref[...]
        kbound = kbound_ref[pl.program_id(1) * kv_heads + lax.div(pl.program_id(0), groups)]
        qf = q.astype(F32)
        shift = jnp.sqrt(jnp.sum(qf * qf, axis=1)) * kbound
        use_bound = jnp.max(shift) <= BOUND_SHIFT_MAX
        zeros = (jnp.zeros(q.shape, F32), jnp.zeros(shift.shape, F32))
        o, lse = lax.cond(use_bound, lambda: attend(q, shift), lambda: zeros)
        store(o, jnp.where(use_bound, lse, jnp.nan))
    else:
        flagged = jnp.sum(jnp.isnan(lse_in_ref[...]).astype(jnp.int32)) > 0

        @pl.when(flagged)
        def _():
            store(*attend(q_ref[...]))


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks):
    """-> (o [B, Tp, H, dp] q.dtype, lse2 [B, H, Tp] fp32). With the 'bound' shift (bf16 / fp16 inputs; fp32 ones
    keep the online loop: an exponent argument down to -2 * BOUND_SHIFT_MAX carries ~2^-17 relative rounding into
    its term, far below bf16's 2^-9 but not below fp32's tolerance) a second launch redoes the tiles that could
    not take it; with CCA's normalised queries and keys its programs only read their lse and return."""
    B, Tp, H, dp = q.shape
    Sp, KV = k.shape[1], k.shape[2]
    bq, bk = blocks.fwd_q, blocks.fwd_k
    bound = blocks.fwd_shift == "bound" and q.dtype != F32
    kbound = None
    if bound:  # flat [B * KV], padded to a power of two (a whole-array block)
        kbound = key_norm_bound(k, scale).reshape(-1)
        kbound = jnp.pad(kbound, (0, platform.next_pow2(max(16, B * KV)) - B * KV))
    ranges, q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, kbound = vma.vary_to_union(
        ranges, q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, kbound)
    sp = _query_grid_specs(B, Tp, Sp, H, KV, dp, bq)
    opt_specs, opt_arrays = _optional_inputs(sp["q_vec"], sp["kv_vec"], q_seg, kv_seg, window)
    in_specs = [sp["ranges"], sp["q"], sp["kv"], sp["kv"], sp["q_vec"], sp["kv_vec"]]
    args = [ranges, q, k, v, q_pos, kv_pos]

    def call(mode, extra_specs, extra_args, aliases=None):
        return pl.pallas_call(
            functools.partial(_fwd_kernel, c=scale * LOG2E, block_k=bk, has_seg=q_seg is not None,
                              has_window=window is not None, mode=mode, kv_heads=KV, groups=H // KV),
            grid=(H, B, Tp // bq),
            in_specs=in_specs + extra_specs + opt_specs,
            out_specs=[sp["q"], sp["stats"]],
            out_shape=[vma.out_struct(q.shape, q.dtype, q), vma.out_struct((B, H, Tp), F32, q)],
            input_output_aliases=aliases or {},
            compiler_params=platform.compiler_params(blocks.fwd_warps, blocks.fwd_stages),
            interpret=platform.interpret(), name=f"cca_attention_fwd{'' if mode == 'online' else '_' + mode}",
        )(*args, *extra_args, *opt_arrays)

    if not bound:
        return call("online", [], [])
    o, lse2 = call("bound", [pl.BlockSpec(kbound.shape, lambda *_: (0,))], [kbound])
    aliases = {len(args): 0, len(args) + 1: 1}  # o and lse come right after the fixed inputs
    return call("fallback", [sp["q"], sp["stats"]], [o, lse2], aliases)


# ----------------------------------------------------------------------------------------------------------- dq
def _dq_kernel(rng_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest, c, scale,
               block_k, has_seg, has_window):
    qs_ref, ks_ref, window, (dq_ref,) = _optional_refs(rest, has_seg, has_window, 1)
    q, do = q_ref[...], do_ref[...]
    lse = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]
    q_pos = qp_ref[...][:, None]
    q_seg = qs_ref[...][:, None] if has_seg else None

    def run(lo, hi, dq, masked):
        def step(j, dq):
            start = pl.multiple_of(j * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            qk = plgpu.dot(q, k, trans_b=True)
            if masked:
                kv_seg = ks_ref[pl.ds(start, block_k)][None, :] if has_seg else None
                ok = _visible(q_pos, kp_ref[pl.ds(start, block_k)][None, :], q_seg, kv_seg, window)
                p = jnp.exp2(jnp.where(ok, qk * c, NEG) - lse)
            else:
                p = jnp.exp2(qk * c - lse)
            dp = plgpu.dot(do, v_ref[pl.ds(start, block_k), :], trans_b=True)
            ds = p * (dp - delta)
            return dq + plgpu.dot(ds.astype(k.dtype), k)
        return lax.fori_loop(lo, hi, step, dq)

    dq = _three_loops(rng_ref, run, jnp.zeros(q.shape, F32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def backward_dq(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks):
    B, Tp, H, dp = q.shape
    Sp, KV = k.shape[1], k.shape[2]
    bq, bk = blocks.dq_q, blocks.dq_k
    ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window = vma.vary_to_union(
        ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window)
    sp = _query_grid_specs(B, Tp, Sp, H, KV, dp, bq)
    opt_specs, opt_arrays = _optional_inputs(sp["q_vec"], sp["kv_vec"], q_seg, kv_seg, window)
    in_specs = [sp["ranges"], sp["q"], sp["kv"], sp["kv"], sp["q"], sp["stats"], sp["stats"], sp["q_vec"],
                sp["kv_vec"]] + opt_specs
    return pl.pallas_call(
        functools.partial(_dq_kernel, c=scale * LOG2E, scale=scale, block_k=bk,
                          has_seg=q_seg is not None, has_window=window is not None),
        grid=(H, B, Tp // bq),
        in_specs=in_specs,
        out_specs=sp["q"],
        out_shape=vma.out_struct(q.shape, q.dtype, q),
        compiler_params=platform.compiler_params(blocks.dq_warps, blocks.dq_stages),
        interpret=platform.interpret(), name="cca_attention_dq",
    )(ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, *opt_arrays)


# ------------------------------------------------------------------------------------------------------- dk, dv
def _dkv_kernel(rng_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest, c, scale,
                block_q, groups, heads, has_seg, has_window, store_ds):
    """One key block of one KV head; loops over (query block, block of `heads` query heads) pairs of its group.
    The logits are computed transposed ([block_k, query rows]) so dk and dv accumulate without transposes.
    store_ds: step t also writes its ds tile [block_k, query rows] whole to dS tile rng[4] + t (`ds_tile_offsets`)."""
    if store_ds:
        qs_ref, ks_ref, window, (dk_ref, dv_ref, ds_ref) = _optional_refs(rest, has_seg, has_window, 3)
    else:
        qs_ref, ks_ref, window, (dk_ref, dv_ref) = _optional_refs(rest, has_seg, has_window, 2)
    k, v = k_ref[...], v_ref[...]
    kv_pos = kp_ref[...][:, None]
    kv_seg = ks_ref[...][:, None] if has_seg else None
    head_blocks = groups // heads
    # Stacked rows are gathered straight from memory: row r is (position start + r // heads, head h0 + r % heads).
    # No in-kernel reshape of [block_q, heads, dp] tiles (or [heads, block_q] statistics): with those, dk (and
    # only dk) came out 5-16% wrong and run-to-run different on the H200 while exact in interpret mode.
    row = lax.broadcasted_iota(jnp.int32, (block_q * heads,), 0)
    row_pos, row_head = lax.div(row, heads), lax.rem(row, heads)

    def run(lo, hi, carry, masked):
        first_tile = rng_ref[4] + (lo - rng_ref[0]) * head_blocks if store_ds else None

        def step(t, carry):
            dk, dv = carry
            # consecutive steps share a query block, so its positions and masks stay in cache
            h0 = lax.rem(t, head_blocks) * heads
            start = pl.multiple_of((lo + lax.div(t, head_blocks)) * block_q, block_q)
            if heads == 1:
                pos, hd = pl.ds(start, block_q), h0
            else:
                pos, hd = start + row_pos, h0 + row_head
            q, do = q_ref[pos, hd, :], do_ref[pos, hd, :]  # [query rows, dp]
            qk_t = plgpu.dot(k, q, trans_b=True)  # [block_k, query rows]
            lse = lse_ref[hd, pos][None, :]
            if masked:
                q_seg = qs_ref[pos][None, :] if has_seg else None
                ok = _visible(qp_ref[pos][None, :], kv_pos, q_seg, kv_seg, window)
                p_t = jnp.exp2(jnp.where(ok, qk_t * c, NEG) - lse)
            else:
                p_t = jnp.exp2(qk_t * c - lse)
            dv = dv + plgpu.dot(p_t.astype(do.dtype), do)
            dp_t = plgpu.dot(v, do, trans_b=True)
            ds_t = (p_t * (dp_t - delta_ref[hd, pos][None, :])).astype(q.dtype)
            if store_ds:
                ds_ref[first_tile + t] = ds_t
            return dk + plgpu.dot(ds_t, q), dv
        return lax.fori_loop(0, (hi - lo) * head_blocks, step, carry)

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = _three_loops(rng_ref, run, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dkv_split(heads: int, kv_heads: int, batch: int, n_kv_blocks: int, requested: int) -> int:
    """Programs per KV head (each takes an equal share of its query heads). With few KV heads and a small batch
    there are fewer (KV head, key block) programs than compute units, and under causal masks the first key blocks
    carry most of the work; then the query heads of a group are split over several programs whose fp32 partial
    dk/dv are summed afterwards. On the H200 at B=4, T=4096 (256 programs) splitting measured slower (the partial
    sums cost more than the balance gains; docs/experiments.md), so the split only fills an under-filled GPU."""
    groups = heads // kv_heads
    if requested:
        if groups % requested:
            raise ValueError(f"dkv_split={requested} must divide the {groups} query heads per KV head")
        return requested
    want = platform.compute_units()
    return next((s for s in range(1, groups + 1) if groups % s == 0 and kv_heads * s * batch * n_kv_blocks >= want),
                groups)


def backward_dkv(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks):
    """-> (dk, dv) in k.dtype."""
    return _dkv_call(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, scale=scale,
                     blocks=blocks)


def dkv_layout(H: int, KV: int, B: int, Sp: int, blocks) -> tuple[int, int, int]:
    """(split, groups, heads) of the dk/dv kernel: programs per KV head, query heads per program, heads per tile."""
    split = dkv_split(H, KV, B, Sp // blocks.dkv_k, blocks.dkv_split)
    groups = H // KV // split
    return split, groups, stacked_heads(groups, blocks.dkv_heads)


def _dkv_call(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks,
              n_tiles=None):
    B, Tp, H, dp = q.shape
    Sp, KV = k.shape[1], k.shape[2]
    bq, bk = blocks.dkv_q, blocks.dkv_k
    nk = Sp // bk
    split, groups, heads = dkv_layout(H, KV, B, Sp, blocks)
    store_ds = n_tiles is not None
    has_seg = q_seg is not None
    ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window = vma.vary_to_union(
        ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window)
    # Program axis 0 = KV head * split + share; its query heads are share-block `g` of size `groups`.
    # Key block j = program axis 2 ascending: the first key blocks see the most queries under causal masks.
    group_spec = pl.BlockSpec((None, Tp, groups, dp), lambda g, b, j: (b, 0, g, 0))
    rows_spec = pl.BlockSpec((None, groups, Tp), lambda g, b, j: (b, g, 0))
    kv_spec = pl.BlockSpec((None, bk, None, dp), lambda g, b, j: (b, j, lax.div(g, split), 0))
    out_spec = pl.BlockSpec((None, bk, None, dp), lambda g, b, j: (b, j, g, 0))
    q_vec = pl.BlockSpec((None, Tp), lambda g, b, j: (b, 0))
    kv_vec = pl.BlockSpec((None, bk), lambda g, b, j: (b, j))
    opt_specs, opt_arrays = _optional_inputs(q_vec, kv_vec, q_seg, kv_seg, window)
    in_specs = [pl.BlockSpec((None, None, ranges.shape[-1]), lambda g, b, j: (b, j, 0)), group_spec, kv_spec,
                kv_spec, group_spec, rows_spec, rows_spec, q_vec, kv_vec] + opt_specs
    out_dtype = k.dtype if split == 1 else F32  # partial sums stay fp32 until they are added
    out_shape = vma.out_struct((B, Sp, KV * split, dp), out_dtype, q)
    args = [ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, *opt_arrays]
    out_specs, out_shapes = [out_spec, out_spec], [out_shape, out_shape]
    if store_ds:  # the program's own dS tiles (only those its loop visits are written)
        out_specs.append(pl.BlockSpec((None, None, n_tiles, bk, bq * heads), lambda g, b, j: (b, g, 0, 0, 0)))
        out_shapes.append(vma.out_struct((B, KV * split, n_tiles, bk, bq * heads), q.dtype, q))
    outs = pl.pallas_call(
        functools.partial(_dkv_kernel, c=scale * LOG2E, scale=scale, block_q=bq, groups=groups, heads=heads,
                          has_seg=has_seg, has_window=window is not None, store_ds=store_ds),
        grid=(KV * split, B, nk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        compiler_params=platform.compiler_params(blocks.dkv_warps, blocks.dkv_stages),
        interpret=platform.interpret(), name="cca_attention_dkv",
    )(*args)
    dk, dv = outs[0], outs[1]
    if split > 1:
        dk = dk.reshape(B, Sp, KV, split, dp).sum(axis=3)
        dv = dv.reshape(B, Sp, KV, split, dp).sum(axis=3)
    dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return (dk, dv, outs[2]) if store_ds else (dk, dv)


# ---------------------------------------------------------------------------------------------- dq from dS tiles
def ds_tile_offsets(dkv_ranges, n_q_blocks: int, head_blocks: int, static: bool):
    """-> (ranges [B, nk, 8]: the dk/dv loop ranges with column 4 = the key block's first dS tile, n_tiles).

    Key block j's program writes one tile per (query block, head block) step of its range [lo, hi), so its tiles
    start at the running sum of (hi - lo) * head_blocks over the key blocks before it. n_tiles (static) is the
    largest such total over the batch: exact with static ranges, otherwise every (key block, query block) pair."""
    xp = np if static else jnp
    if static:
        dkv_ranges = np.asarray(dkv_ranges)
    count = (dkv_ranges[..., 3] - dkv_ranges[..., 0]) * head_blocks
    first = xp.cumsum(count, axis=-1) - count
    pad = xp.zeros(dkv_ranges.shape[:-1] + (3,), np.int32)
    out = xp.concatenate([dkv_ranges, first[..., None].astype(np.int32), pad], axis=-1)
    if static:
        return jnp.asarray(out), max(1, int(count.sum(axis=-1).max()))
    return out, dkv_ranges.shape[1] * n_q_blocks * head_blocks


def ds_tile_plan(q_shape, kv_shape, dtype, blocks, dkv_ranges, static: bool):
    """-> (dk/dv loop ranges with dS tile offsets, n_tiles, dS bytes) of the 'tiles' backward for q [B, Tp, H, dp]
    and k/v [B, Sp, KV, dp]; dkv_ranges are NumPy with static positions."""
    B, Tp, H, _ = q_shape
    split, groups, heads = dkv_layout(H, kv_shape[2], B, kv_shape[1], blocks)
    ranges, n_tiles = ds_tile_offsets(dkv_ranges, Tp // blocks.dkv_q, groups // heads, static)
    ds_bytes = B * kv_shape[2] * split * n_tiles * blocks.dkv_k * blocks.dkv_q * heads * jnp.dtype(dtype).itemsize
    return ranges, n_tiles, ds_bytes


def backward_dkv_tiles(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks,
                       n_tiles):
    """-> (dk, dv) in k.dtype and dS tiles [B, programs, n_tiles, dkv_k, dkv_q * heads] in q.dtype, key-major,
    WITHOUT the softmax scale; `ranges` from `ds_tile_offsets`. Tiles outside every loop are left unwritten."""
    return _dkv_call(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, scale=scale,
                     blocks=blocks, n_tiles=n_tiles)


def _dq_tiles_kernel(qrng_ref, krng_ref, k_ref, ds_ref, dq_ref, *, scale, block_q, block_k, heads, head_blocks,
                     n_q_blocks):
    """dq of one dk/dv query tile (block_q positions x `heads` heads of one head block): the sum over the key blocks
    in its range of dS-tileᵀ . K. A key block whose dk/dv loop skipped this query block wrote no tile: it adds 0."""
    i = n_q_blocks - 1 - pl.program_id(2)  # heaviest query blocks first
    hb = lax.rem(pl.program_id(0), head_blocks)
    rows = block_q * heads

    def step(j, dq):
        k_lo, k_hi = krng_ref[j, 0], krng_ref[j, 3]
        written = (k_lo <= i) & (i < k_hi)
        tile = jnp.where(written, krng_ref[j, 4] + (i - k_lo) * head_blocks + hb, 0)
        ds_t = ds_ref[tile]
        ds_t = jnp.where(written, ds_t, jnp.zeros_like(ds_t))
        kt = k_ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k), :]
        return dq + plgpu.dot(ds_t, kt, trans_a=True)

    dq = lax.fori_loop(qrng_ref[0], qrng_ref[3], step, jnp.zeros((rows, k_ref.shape[-1]), F32))
    dq = (dq * scale).astype(dq_ref.dtype)
    start = i * block_q
    if heads == 1:
        dq_ref[pl.ds(start, block_q), hb, :] = dq
    else:  # stacked rows back to (position, head): integer indices on every axis, as the dk/dv kernel reads them
        row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        col = lax.broadcasted_iota(jnp.int32, (dq.shape[1],), 0)
        pos, hd = start + lax.div(row, heads), hb * heads + lax.rem(row, heads)
        dq_ref[pos[:, None], hd[:, None], col[None, :]] = dq


def backward_dq_tiles(ds, k, q_ranges, kv_ranges, *, scale, blocks, q_shape, q_dtype):
    """dq [B, Tp, H, dp] in q_dtype from the dS tiles of `backward_dkv_tiles`. q_ranges [B, Tp // dkv_q, 4] are the
    key-block loop ranges of each dk/dv query block, kv_ranges those of `ds_tile_offsets`."""
    B, Tp, H, dp = q_shape
    Sp, KV = k.shape[1], k.shape[2]
    bq, bk = blocks.dkv_q, blocks.dkv_k
    split, groups, heads = dkv_layout(H, KV, B, Sp, blocks)
    head_blocks = groups // heads
    n_tiles, nq = ds.shape[2], Tp // bq
    ds, k, q_ranges, kv_ranges = vma.vary_to_union(ds, k, q_ranges, kv_ranges)
    return pl.pallas_call(
        functools.partial(_dq_tiles_kernel, scale=scale, block_q=bq, block_k=bk, heads=heads,
                          head_blocks=head_blocks, n_q_blocks=nq),
        grid=(KV * split * head_blocks, B, nq),
        in_specs=[pl.BlockSpec((None, None, 4), lambda g, b, i: (b, nq - 1 - i, 0)),
                  pl.BlockSpec((None, kv_ranges.shape[1], 8), lambda g, b, i: (b, 0, 0)),
                  pl.BlockSpec((None, Sp, None, dp), lambda g, b, i: (b, 0, lax.div(g, split * head_blocks), 0)),
                  pl.BlockSpec((None, None, n_tiles, bk, bq * heads),
                               lambda g, b, i: (b, lax.div(g, head_blocks), 0, 0, 0))],
        out_specs=pl.BlockSpec((None, Tp, groups, dp), lambda g, b, i: (b, 0, lax.div(g, head_blocks), 0)),
        out_shape=vma.out_struct((B, Tp, H, dp), q_dtype, ds),
        compiler_params=platform.compiler_params(blocks.tiles_dq_warps, blocks.tiles_dq_stages),
        interpret=platform.interpret(), name="cca_attention_dq_tiles",
    )(q_ranges, kv_ranges, k, ds)

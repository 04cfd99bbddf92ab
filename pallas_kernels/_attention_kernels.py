"""Flash-attention kernels for grouped-query attention (Pallas, Triton lowering): forward, dq, and dk/dv.

Layouts: q/o/dq [B, Tp, H, dp], k/v/dk/dv [B, Sp, KV, dp], lse/delta [B, H, Tp] fp32, positions/segments
[B, Tp] / [B, Sp] int32, the sliding window a [1] int32 array (or None; an array so that scanned layers may
carry different windows), loop ranges [B, n_blocks, 4] int32 (see `_attention_blocks`). Tp, Sp are multiples of
every block size and dp is a power of two >= 16; the wrapper pads. Query head h reads KV head h // groups through
the BlockSpec index map, so repeated K/V are never materialised.

Logits are kept in base 2: s2 = (q . k) * scale * log2(e), so the softmax uses exp2 and the saved statistic is
lse2 = log2(sum 2^s2). Masked logits are NEG; a row that sees no key gets lse2 = DEAD_LSE and a zero output, so
every exp2(s2 - lse2) of the backward is 0 for it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _platform

F32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1.0e30
DEAD_LSE = 1.0e30


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


# ------------------------------------------------------------------------------------------------------ forward
def _fwd_kernel(rng_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest, c, block_k, has_seg, has_window):
    qs_ref, ks_ref, window, (o_ref, lse_ref) = _optional_refs(rest, has_seg, has_window, 2)
    q = q_ref[...]
    block_q, dp = q.shape
    q_pos = qp_ref[...][:, None]
    q_seg = qs_ref[...][:, None] if has_seg else None

    def run(lo, hi, carry, masked):
        def step(j, carry):
            acc, m, l = carry
            start = pl.multiple_of(j * block_k, block_k)
            s = plgpu.dot(q, k_ref[pl.ds(start, block_k), :], trans_b=True) * c
            if masked:
                kv_seg = ks_ref[pl.ds(start, block_k)][None, :] if has_seg else None
                ok = _visible(q_pos, kp_ref[pl.ds(start, block_k)][None, :], q_seg, kv_seg, window)
                s = jnp.where(ok, s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            v = v_ref[pl.ds(start, block_k), :]
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
            return acc, m_new, l * alpha + jnp.sum(p, axis=1)
        return lax.fori_loop(lo, hi, step, carry)

    init = (jnp.zeros((block_q, dp), F32), jnp.full((block_q,), NEG, F32), jnp.zeros((block_q,), F32))
    acc, m, l = _three_loops(rng_ref, run, init)
    live = m > 0.5 * NEG
    o_ref[...] = jnp.where(live[:, None], acc / l[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(live, m + jnp.log2(l), DEAD_LSE)


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks):
    """-> (o [B, Tp, H, dp] q.dtype, lse2 [B, H, Tp] fp32)."""
    B, Tp, H, dp = q.shape
    Sp, KV = k.shape[1], k.shape[2]
    groups, bq, bk = H // KV, blocks.fwd_q, blocks.fwd_k
    nq = Tp // bq
    has_seg = q_seg is not None

    def qi(i):  # heaviest (last) query blocks launch first: shorter tail under causal imbalance
        return nq - 1 - i

    q_spec = pl.BlockSpec((None, bq, None, dp), lambda h, b, i: (b, qi(i), h, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, dp), lambda h, b, i: (b, 0, lax.div(h, groups), 0))
    q_vec = pl.BlockSpec((None, bq), lambda h, b, i: (b, qi(i)))
    kv_vec = pl.BlockSpec((None, Sp), lambda h, b, i: (b, 0))
    opt_specs, opt_arrays = _optional_inputs(q_vec, kv_vec, q_seg, kv_seg, window)
    in_specs = [pl.BlockSpec((None, None, 4), lambda h, b, i: (b, qi(i), 0)), q_spec, kv_spec, kv_spec, q_vec,
                kv_vec] + opt_specs
    return pl.pallas_call(
        functools.partial(_fwd_kernel, c=scale * LOG2E, block_k=bk, has_seg=has_seg,
                          has_window=window is not None),
        grid=(H, B, nq),
        in_specs=in_specs,
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda h, b, i: (b, h, qi(i)))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, Tp), F32)],
        compiler_params=_platform.compiler_params(blocks.fwd_warps, blocks.fwd_stages),
        interpret=_platform.interpret(), name="cca_attention_fwd",
    )(ranges, q, k, v, q_pos, kv_pos, *opt_arrays)


# ----------------------------------------------------------------------------------------------------------- dq
def _dq_kernel(rng_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest, c, scale,
               block_k, has_seg, has_window):
    qs_ref, ks_ref, window, (dq_ref,) = _optional_refs(rest, has_seg, has_window, 1)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    q_pos = qp_ref[...][:, None]
    q_seg = qs_ref[...][:, None] if has_seg else None

    def run(lo, hi, dq, masked):
        def step(j, dq):
            start = pl.multiple_of(j * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            s = plgpu.dot(q, k, trans_b=True) * c
            if masked:
                kv_seg = ks_ref[pl.ds(start, block_k)][None, :] if has_seg else None
                ok = _visible(q_pos, kp_ref[pl.ds(start, block_k)][None, :], q_seg, kv_seg, window)
                s = jnp.where(ok, s, NEG)
            p = jnp.exp2(s - lse)
            dp = plgpu.dot(do, v_ref[pl.ds(start, block_k), :], trans_b=True)
            ds = p * (dp - delta)
            return dq + plgpu.dot(ds.astype(k.dtype), k)
        return lax.fori_loop(lo, hi, step, dq)

    dq = _three_loops(rng_ref, run, jnp.zeros(q.shape, F32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def backward_dq(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks):
    B, Tp, H, dp = q.shape
    Sp, KV = k.shape[1], k.shape[2]
    groups, bq, bk = H // KV, blocks.dq_q, blocks.dq_k
    nq = Tp // bq
    has_seg = q_seg is not None

    def qi(i):
        return nq - 1 - i

    q_spec = pl.BlockSpec((None, bq, None, dp), lambda h, b, i: (b, qi(i), h, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, dp), lambda h, b, i: (b, 0, lax.div(h, groups), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda h, b, i: (b, h, qi(i)))
    q_vec = pl.BlockSpec((None, bq), lambda h, b, i: (b, qi(i)))
    kv_vec = pl.BlockSpec((None, Sp), lambda h, b, i: (b, 0))
    opt_specs, opt_arrays = _optional_inputs(q_vec, kv_vec, q_seg, kv_seg, window)
    in_specs = [pl.BlockSpec((None, None, 4), lambda h, b, i: (b, qi(i), 0)), q_spec, kv_spec, kv_spec, q_spec,
                row_spec, row_spec, q_vec, kv_vec] + opt_specs
    return pl.pallas_call(
        functools.partial(_dq_kernel, c=scale * LOG2E, scale=scale, block_k=bk, has_seg=has_seg,
                          has_window=window is not None),
        grid=(H, B, nq),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_platform.compiler_params(blocks.dq_warps, blocks.dq_stages),
        interpret=_platform.interpret(), name="cca_attention_dq",
    )(ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, *opt_arrays)


# ------------------------------------------------------------------------------------------------------- dk, dv
def _dkv_kernel(rng_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest, c, scale,
                block_q, groups, has_seg, has_window):
    """One key block of one KV head; loops over (query block, query head of the group) pairs."""
    qs_ref, ks_ref, window, (dk_ref, dv_ref) = _optional_refs(rest, has_seg, has_window, 2)
    k, v = k_ref[...], v_ref[...]
    kv_pos = kp_ref[...][:, None]
    kv_seg = ks_ref[...][:, None] if has_seg else None

    def run(lo, hi, carry, masked):
        def step(t, carry):
            dk, dv = carry
            head = lax.rem(t, groups)  # consecutive steps share a query block, so its positions stay in cache
            start = pl.multiple_of((lo + lax.div(t, groups)) * block_q, block_q)
            q = q_ref[pl.ds(start, block_q), head, :]
            do = do_ref[pl.ds(start, block_q), head, :]
            s_t = plgpu.dot(k, q, trans_b=True) * c  # [block_k, block_q]: transposed logits
            if masked:
                q_seg = qs_ref[pl.ds(start, block_q)][None, :] if has_seg else None
                ok = _visible(qp_ref[pl.ds(start, block_q)][None, :], kv_pos, q_seg, kv_seg, window)
                s_t = jnp.where(ok, s_t, NEG)
            p_t = jnp.exp2(s_t - lse_ref[head, pl.ds(start, block_q)][None, :])
            dv = dv + plgpu.dot(p_t.astype(do.dtype), do)
            dp_t = plgpu.dot(v, do, trans_b=True)
            ds_t = p_t * (dp_t - delta_ref[head, pl.ds(start, block_q)][None, :])
            return dk + plgpu.dot(ds_t.astype(q.dtype), q), dv
        return lax.fori_loop(0, (hi - lo) * groups, step, carry)

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = _three_loops(rng_ref, run, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dkv_split(heads: int, kv_heads: int, batch: int, n_kv_blocks: int, requested: int) -> int:
    """Programs per KV head (each takes an equal share of its query heads). With few KV heads and a small batch
    there are fewer (KV head, key block) programs than compute units, and under causal masks the first key blocks
    carry most of the work; then the query heads of a group are split over several programs whose fp32 partial
    dk/dv are summed afterwards. On the H200 at B=4, T=4096 (256 programs) splitting measured slower (0.79 vs
    0.71 ms: the partial sums cost more than the balance gains), so the split only fills an under-filled GPU."""
    groups = heads // kv_heads
    if requested:
        if groups % requested:
            raise ValueError(f"dkv_split={requested} must divide the {groups} query heads per KV head")
        return requested
    want = _platform.compute_units()
    return next((s for s in range(1, groups + 1) if groups % s == 0 and kv_heads * s * batch * n_kv_blocks >= want),
                groups)


def backward_dkv(q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, window, ranges, *, scale, blocks):
    B, Tp, H, dp = q.shape
    Sp, KV = k.shape[1], k.shape[2]
    bq, bk = blocks.dkv_q, blocks.dkv_k
    nk = Sp // bk
    split = dkv_split(H, KV, B, nk, blocks.dkv_split)
    groups = H // KV // split  # query heads per program
    has_seg = q_seg is not None
    # Program axis 0 = KV head * split + share; its query heads are share-block `g` of size `groups`.
    # Key block j = program axis 2 ascending: the first key blocks see the most queries under causal masks.
    group_spec = pl.BlockSpec((None, Tp, groups, dp), lambda g, b, j: (b, 0, g, 0))
    rows_spec = pl.BlockSpec((None, groups, Tp), lambda g, b, j: (b, g, 0))
    kv_spec = pl.BlockSpec((None, bk, None, dp), lambda g, b, j: (b, j, lax.div(g, split), 0))
    out_spec = pl.BlockSpec((None, bk, None, dp), lambda g, b, j: (b, j, g, 0))
    q_vec = pl.BlockSpec((None, Tp), lambda g, b, j: (b, 0))
    kv_vec = pl.BlockSpec((None, bk), lambda g, b, j: (b, j))
    opt_specs, opt_arrays = _optional_inputs(q_vec, kv_vec, q_seg, kv_seg, window)
    in_specs = [pl.BlockSpec((None, None, 4), lambda g, b, j: (b, j, 0)), group_spec, kv_spec, kv_spec, group_spec,
                rows_spec, rows_spec, q_vec, kv_vec] + opt_specs
    out_dtype = k.dtype if split == 1 else F32  # partial sums stay fp32 until they are added
    out_shape = jax.ShapeDtypeStruct((B, Sp, KV * split, dp), out_dtype)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, c=scale * LOG2E, scale=scale, block_q=bq, groups=groups, has_seg=has_seg,
                          has_window=window is not None),
        grid=(KV * split, B, nk),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[out_shape, out_shape],
        compiler_params=_platform.compiler_params(blocks.dkv_warps, blocks.dkv_stages),
        interpret=_platform.interpret(), name="cca_attention_dkv",
    )(ranges, q, k, v, do, lse2, delta, q_pos, kv_pos, *opt_arrays)
    if split > 1:
        dk = dk.reshape(B, Sp, KV, split, dp).sum(axis=3)
        dv = dv.reshape(B, Sp, KV, split, dp).sum(axis=3)
    return dk.astype(k.dtype), dv.astype(v.dtype)

"""A candidate for one decode step's attention over the cache (not in the library: run it, and move it into
pallas_kernels if it wins):

    python -m benchmarks.kernels.probe_decode_attention [--slots 768] [--out FILE.json]

XLA runs the step's attention as about five kernels per layer (~10.5 us at batch 1 on an H100); a one-kernel version
with one program per (row, KV head) took 28 us (docs/experiments.md: two programs at batch 1, each a serial walk over
the cache). Here the slots are split over `splits` programs per (row, KV head), flash-decoding style: each keeps a
running max, sum and value sum over its slots (a KV head's query heads as the rows of one 16-row tile), and one XLA
fusion combines the partial results. Each variant is timed as a chain of `CHAIN` dependent calls inside one
program (each call's output is the next one's query), so a few-microsecond kernel is not hidden behind host dispatch.
Timed against ops.attention's reference at batch 1 and 64 with ZAYA1's heads
(8 query heads over 2 KV heads of 128), a 512-token prompt and `--slots` cache slots, with a sliding window; checks
the outputs agree (the probabilities are not rounded to the value dtype before the value product here)."""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.kernels import bench
from pallas_kernels import platform
from zaya_jax.ops.attention import attention_reference

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))
_NEG = float(jnp.finfo(jnp.float32).min)
ROWS = 16
SLOTS = 32
CHAIN = 64


def _kernel(index_ref, window_ref, q_ref, k_ref, v_ref, valid_ref, m_ref, l_ref, acc_ref, *, group, d, slots,
            per_split, scale, precision):
    b, kv, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    index, window = index_ref[0], window_ref[0]
    rows = jnp.arange(ROWS)
    q = q_ref[b, (kv * group + jnp.minimum(rows, group - 1))[:, None], jnp.arange(d)[None, :]]
    cols = jnp.arange(d)[None, :]
    lo = jnp.maximum(split * per_split, jnp.maximum(index - window + 1, 0))
    hi = jnp.minimum((split + 1) * per_split, index + 1)

    def step(i, carry):
        m, l, acc = carry
        slot = lo + i * SLOTS + jnp.arange(SLOTS)
        at = jnp.minimum(slot, slots - 1)
        s = lax.dot_general(q, k_ref[b, at[:, None], kv, cols], _NT, precision=precision, preferred_element_type=F32)
        s = s.astype(q.dtype).astype(F32) * scale
        s = jnp.where(((slot < hi) & (valid_ref[b, at] != 0))[None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + lax.dot_general(p.astype(v_ref.dtype), v_ref[b, at[:, None], kv, cols], _NN,
                                                     precision=precision, preferred_element_type=F32)
        return m_new, l * alpha + jnp.sum(jnp.where(s > _NEG, p, 0.0), axis=1), acc

    m, l, acc = lax.fori_loop(0, jnp.maximum(hi - lo + SLOTS - 1, 0) // SLOTS, step,
                              (jnp.full((ROWS,), _NEG, F32), jnp.zeros((ROWS,), F32), jnp.zeros((ROWS, d), F32)))
    m_ref[b, kv, split, :] = m
    l_ref[b, kv, split, :] = l
    acc_ref[b, kv, split, :, :] = acc


def decode_attention(q, k, v, kv_valid, index, window, *, splits: int, scale=None):
    """q [B, H, d], k / v [B, S, KV, d], kv_valid [B, S], index (the query's slot), window -> o [B, H, d]."""
    B, H, d = q.shape
    S, KV = k.shape[1], k.shape[2]
    group = H // KV
    scale = d ** -0.5 if scale is None else scale
    per_split = -(-S // splits)
    kernel = functools.partial(_kernel, group=group, d=d, slots=S, per_split=per_split, scale=float(scale),
                               precision=platform.dot_precision(q.dtype))
    shapes = (jax.ShapeDtypeStruct((B, KV, splits, ROWS), F32), jax.ShapeDtypeStruct((B, KV, splits, ROWS), F32),
              jax.ShapeDtypeStruct((B, KV, splits, ROWS, d), F32))
    m, l, acc = pl.pallas_call(kernel, grid=(B, KV, splits), out_shape=shapes,
                               compiler_params=platform.compiler_params(4, 2), interpret=platform.interpret(),
                               name="decode_attention_split")(
        jnp.reshape(index, (1,)).astype(jnp.int32), jnp.full((1,), window, jnp.int32), q, k, v,
        kv_valid.astype(jnp.int32))
    top = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - top)
    o = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]  # [B, KV, ROWS, d]
    return o[:, :, :group].reshape(B, H, d).astype(q.dtype)


def chained(attend):
    """jit of q, k, v -> q after CHAIN dependent calls of attend(q [B, H, d], k, v) -> [B, H, d]."""
    return jax.jit(lambda q, k, v: lax.fori_loop(0, CHAIN, lambda _, q: attend(q, k, v), q))


def chain_us(attend, q, k, v):
    return round(bench.time_call(chained(attend), q, k, v) * 1e6 / CHAIN, 2)


def case(B, S, prompt, dtype, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q, k, v = normal(B, 1, 8, 128), normal(B, S, 2, 128), normal(B, S, 2, 128)
    index = prompt + S // 8  # a few steps into the generation
    pads = rng.integers(0, prompt // 4, B)
    kv_valid = (jnp.arange(S)[None] >= pads[:, None]) & (jnp.arange(S) <= index)[None]
    return q, k, v, kv_valid, index


def _split_attention(q, k, v, *, kv_valid, index, window, splits):
    return decode_attention(q, k, v, kv_valid, index, window, splits=splits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quick = platform.vendor() == "cpu"
    S, prompt = (96, 48) if quick else (args.slots, 512)
    report = dict(device=bench.device_summary(), slots=S, rows={})
    for B in (1,) if quick else (1, 64):
        for window in (1 << 30, 256):
            q, k, v, kv_valid, index = case(B, S, prompt, jnp.bfloat16)
            ref = lambda q, k, v: attention_reference(
                q[:, None], k, v, q_positions=jnp.full((1, 1), index, jnp.int32), kv_positions=jnp.arange(S)[None],
                kv_valid=kv_valid, sliding_window=window)[:, 0]
            q = q[:, 0]
            want = jax.jit(ref)(q, k, v).astype(F32)
            row = dict(xla_us=chain_us(ref, q, k, v))
            for splits in ((2,) if quick else (4, 8, 16, 32)):
                fn = functools.partial(_split_attention, kv_valid=kv_valid, index=index, window=window, splits=splits)
                got = jax.jit(fn)(q, k, v).astype(F32)
                row[f"splits_{splits}_us"] = chain_us(fn, q, k, v)
                row[f"splits_{splits}_max_abs_diff"] = float(jnp.abs(got - want).max())
            report["rows"][f"batch_{B}_window_{window if window < 1 << 30 else 'none'}"] = row
            print(B, window, row, flush=True)
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

"""The chunked vocabulary head + cross-entropy (zaya_jax/model/loss.py), forward and backward, next to its floor.

    python -m benchmarks.bench_ce [--tokens 8192 --hidden 2048 --vocab 262272 --chunk 4096 --reps 7]

Times value_and_grad over (hidden, head weight) of `chunked_head_cross_entropy` as the bench step runs it (bf16
hidden states, fp32 head weight), and, on the same inputs, the three head GEMMs alone (logits, d hidden, d weight):
what is left over them is the softmax / log-partition / d-logits passes over the [chunk, vocab] logits, the weight
cast and the fp32 d-weight sum. Both implementations of that part (zaya_jax/ops/cross_entropy.py: XLA's fusions,
the Pallas kernel) are timed in the same run (medians of repeated timings), with the bf16 GEMM ceiling and copy
bandwidth of this device.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels import softmax_xent as pk
from benchmarks.kernels.bench import copy_ceiling_tbps, gemm_ceiling_tflops, time_call
from pallas_kernels.softmax_xent import XentLaunch
from zaya_jax.model import loss
from zaya_jax.ops.cross_entropy import IMPLS, softmax_xent_reference

# (block, warps, prefetch, reversed second pass) candidates timed with --sweep
SWEEP = [(4096, 8, 1, False), (4096, 16, 1, True), (4096, 8, 2, True), (8192, 8, 1, True), (2048, 8, 2, True),
         (4096, 4, 1, True)]


def problem(tokens: int, hidden: int, vocab: int, seed: int = 0):
    kh, kw, kt = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (tokens, hidden), jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (vocab, hidden), jnp.float32))
    t = jax.random.randint(kt, (tokens,), 0, vocab, jnp.int32)
    return h, w, t, jnp.ones((tokens,), jnp.float32)


def ce_fwd_bwd(chunk: int, impl: str):
    def f(h, w, t, m):
        return loss.chunked_head_cross_entropy(h, w, t, m, chunk_tokens=chunk, impl=impl)[0]
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def head_gemms(chunk: int):
    """The head's GEMMs over the same chunks, in the same dtypes, nothing else."""
    def f(h, w, g):
        wc = w.astype(h.dtype)
        hs, gs = h.reshape(-1, chunk, h.shape[-1]), g.reshape(-1, chunk, g.shape[-1])

        def body(d_w, xs):
            hc, gc = xs
            logits = jnp.einsum("nd,vd->nv", hc, wc)
            d_h = jnp.einsum("nv,vd->nd", gc, wc, preferred_element_type=jnp.float32)
            d_w = d_w + jnp.einsum("nv,nd->vd", gc, hc, preferred_element_type=jnp.float32)
            return d_w, (logits[:, :1], d_h)
        return jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (hs, gs))
    return jax.jit(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=262272)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's launch candidates (SWEEP)")
    ap.add_argument("--out", default="benchmarks/results/ce_h200.json")
    args = ap.parse_args(argv)
    if args.tokens % args.chunk:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --chunk {args.chunk}")
    h, w, t, m = problem(args.tokens, args.hidden, args.vocab)
    report = {"device": jax.devices()[0].device_kind, "shape": vars(args),
              "gemm_bf16_tflops": gemm_ceiling_tflops(), "copy_tbps": copy_ceiling_tbps()}
    g = jnp.zeros((args.tokens, args.vocab), jnp.bfloat16)
    report["gemms_ms"] = 1e3 * time_call(head_gemms(args.chunk), h, w, g, reps=args.reps, calls=3)
    del g
    logits_bytes = args.tokens * args.vocab * 2
    for impl in IMPLS:
        fn = ce_fwd_bwd(args.chunk, impl)
        report[f"{impl}_ms"] = 1e3 * time_call(fn, h, w, t, m, reps=args.reps, calls=3)
        extra = report[f"{impl}_ms"] - report["gemms_ms"]
        report[f"{impl}_over_gemms_ms"] = extra
        # in bf16 reads of all the logits at copy bandwidth, for scale
        report[f"{impl}_over_gemms_in_logit_reads"] = extra * 1e-3 * report["copy_tbps"] * 1e12 / logits_bytes
    # the kernel alone next to XLA's passes on one chunk of logits; bandwidth = 2 reads + 1 write of the logits
    x = jax.random.normal(jax.random.key(1), (args.chunk, args.vocab), jnp.bfloat16)
    tc, mc = t[:args.chunk], m[:args.chunk]
    chunk_bytes = 3 * x.size * x.dtype.itemsize
    kernel_rows = {}
    for launch in [None] + [XentLaunch(*c) for c in SWEEP] * args.sweep:
        fn = jax.jit(lambda a, b, c, launch=launch: pk.softmax_xent(a, b, c, launch))
        ms = 1e3 * time_call(fn, x, tc, mc, reps=args.reps)
        vs_copy = chunk_bytes / (ms * 1e-3) / (report["copy_tbps"] * 1e12)
        kernel_rows[str(launch or "default")] = {"ms": ms, "vs_copy": vs_copy}
    xla_ms = 1e3 * time_call(jax.jit(softmax_xent_reference), x, tc, mc, reps=args.reps)
    report["chunk_kernel"] = {"pallas": kernel_rows, "xla_ms": xla_ms,
                              "pallas_vs_xla": xla_ms / kernel_rows["default"]["ms"]}
    report["pallas_speedup_over_gemms"] = report["xla_over_gemms_ms"] / report["pallas_over_gemms_ms"]
    report["pallas_speedup"] = report["xla_ms"] / report["pallas_ms"]
    print(json.dumps(report, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

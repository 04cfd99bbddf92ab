"""CCA attention backward options against cuDNN: `python -m launch.bench_attention_bwd [--out FILE] [--quick]`.

At B=4, T=4096 and B=1, T=32768 (8 q / 2 kv heads, d=128, causal, bf16) it times cuDNN and each Pallas variant
(the table's split backward, the fused backward with atomic dq under a few dk/dv tilings) end to end through the
public API: forward alone and forward + backward (medians, pallas_kernels/_bench), and checks o, dq, dk, dv against
cuDNN's on the same inputs (relative Frobenius error). Prints ratios cuDNN time / Pallas time (>= 0.8 is the goal)
and writes the JSON after every variant. --budget-s stops starting new variants; --quick: tiny shapes for a CPU
dry run of the same code path (interpret mode, the reference is then the jnp attention and timings mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import warnings

import jax
import jax.numpy as jnp

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from pallas_kernels import _bench as bench  # noqa: E402
from pallas_kernels import _platform  # noqa: E402

H, KV, D = 8, 2, 128

# Variant name -> fields replaced in the table's row for the shape (which includes the long-sequence forward).
# Variants named split_qXhY / atomic_qXhY fix the dk/dv tiling (dkv_q=X positions x Y stacked heads); fwd_qXkYwZsS[hH]
# fix the forward's (query x key tile, warps, pipeline stages, stacked heads) and keep the row's backward; the
# others keep the row's.
VARIANTS = {
    "split": {},
    "split_q32h2": dict(dkv_q=32, dkv_heads=2),
    "split_q16h4": dict(dkv_q=16, dkv_heads=4),
    "atomic": dict(bwd="atomic"),
    "atomic_q32h2": dict(bwd="atomic", dkv_q=32, dkv_heads=2),
    "atomic_q16h2": dict(bwd="atomic", dkv_q=16, dkv_heads=2),
    "atomic_q32h1": dict(bwd="atomic", dkv_q=32, dkv_heads=1),
    "atomic_q16h4": dict(bwd="atomic", dkv_q=16, dkv_heads=4),
    "fwd_q128k128w8s2": dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=2, fwd_heads=1),
    "fwd_q128k128w8s3": dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=3, fwd_heads=1),
    "fwd_q128k64w8s4": dict(fwd_q=128, fwd_k=64, fwd_warps=8, fwd_stages=4, fwd_heads=1),
    "fwd_q64k128w8s2h2": dict(fwd_q=64, fwd_k=128, fwd_warps=8, fwd_stages=2, fwd_heads=2),
    "fwd_q64k64w4s4": dict(fwd_q=64, fwd_k=64, fwd_warps=4, fwd_stages=4, fwd_heads=1),
}


def _rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def bench_shape(B, T, variants, ref_impl, deadline, report_row, save):
    q, k, v, do = bench._attention_problem(B, T, H, KV, D)
    table = _platform.attention_blocks(D, T)
    report_row["table"] = str(table)
    ref_fwd, ref_fwd_bwd = bench._attention_fns(ref_impl, None)
    t_f, t_fb = bench.time_call(ref_fwd, q, k, v, reps=5, calls=3), bench.time_call(ref_fwd_bwd, q, k, v, do,
                                                                                    reps=5, calls=3)
    ref = ref_fwd_bwd(q, k, v, do)
    ref = (ref[0], *ref[1])
    report_row[ref_impl] = dict(fwd_ms=t_f * 1e3, fwdbwd_ms=t_fb * 1e3)
    print(f"  {ref_impl:13s} B={B} T={T:6d}: fwd {t_f * 1e3:8.3f} ms  fwd+bwd {t_fb * 1e3:8.3f} ms", flush=True)
    save()
    fwd_ms = {}  # forward time per distinct forward config (the backward options share it)
    for name in variants:
        if time.monotonic() > deadline:
            report_row[name] = dict(skipped="budget")
            continue
        blocks = dataclasses.replace(table, **VARIANTS[name])
        fwd, fwd_bwd = bench._attention_fns("pallas", blocks)
        fwd_key = tuple(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith("fwd_"))
        if fwd_key not in fwd_ms:
            fwd_ms[fwd_key], err = bench.attempt(bench.time_call, fwd, q, k, v, reps=5, calls=3)
        else:
            err = None
        t_fb, err2 = bench.attempt(bench.time_call, fwd_bwd, q, k, v, do, reps=5, calls=3)
        if err or err2 or fwd_ms[fwd_key] is None:
            report_row[name] = dict(error=err or err2)
            print(f"  {name:13s} T={T}: {err or err2}", flush=True)
            save()
            continue
        got = fwd_bwd(q, k, v, do)
        got = (got[0], *got[1])
        row = dict(blocks=VARIANTS[name], fwd_ms=fwd_ms[fwd_key] * 1e3, fwdbwd_ms=t_fb * 1e3,
                   bwd_ms=(t_fb - fwd_ms[fwd_key]) * 1e3,
                   fwd_vs_ref=t_f / fwd_ms[fwd_key], fwdbwd_vs_ref=report_row[ref_impl]["fwdbwd_ms"] / 1e3 / t_fb,
                   rel_err={n: _rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)})
        report_row[name] = row
        errs = " ".join(f"{n} {e:.1e}" for n, e in row["rel_err"].items())
        print(f"  {name:13s} B={B} T={T:6d}: fwd {row['fwd_ms']:8.3f} ms  fwd+bwd {row['fwdbwd_ms']:8.3f} ms "
              f"(bwd {row['bwd_ms']:7.3f})  vs {ref_impl}: fwd {row['fwd_vs_ref']:.3f} fwd+bwd "
              f"{row['fwdbwd_vs_ref']:.3f} | err vs {ref_impl}: {errs}", flush=True)
        save()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attn.json"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    ap.add_argument("--budget-s", type=float, default=130.0, help="no new variant starts after this many seconds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU dry run of the code path)")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    t0 = time.monotonic()
    cuda = _platform.vendor() == "cuda"
    ref_impl = "cudnn" if cuda else "xla"
    shapes = ((1, 64), (1, 128)) if args.quick else ((4, 4096), (1, 32768))
    report = dict(device=bench.device_summary(), H=H, KV=KV, d=D, reference=ref_impl, shapes={})

    def save():
        report["elapsed_s"] = time.monotonic() - t0
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    # The 32k shape gets the larger share of the budget: its compiles and runs are the long ones.
    for i, (B, T) in enumerate(shapes):
        print(f"B={B} T={T}", flush=True)
        report["shapes"][f"T{T}"] = row = dict(B=B, T=T)
        deadline = t0 + args.budget_s * (0.4 if i == 0 else 1.0)
        bench_shape(B, T, variants, ref_impl, deadline, row, save)
    save()
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s on {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()

"""CCA attention kernel options against cuDNN: `python -m benchmarks.bench_attention_bwd [--out FILE] [--quick]`.

At B=4, T=4096 and B=1, T=32768 (8 q / 2 kv heads, d=128, causal, bf16; --shapes picks and orders them) it times
cuDNN and each Pallas variant (field overrides of the table's row: backward options, forward, dq and dk/dv
tilings) end to end through the public API: forward alone and forward + backward (medians, benchmarks/kernels/bench),
and checks o, dq, dk, dv against cuDNN's on the same inputs (relative Frobenius error). It also times the backward's
kernels alone (`kernel_ms`: split's dq and dk/dv, or the 'tiles' dk/dv + dS and dq-from-dS; the forward's end-to-end
time as its `fwd`; TFLOP/s of the flops each really does), so a row shows which kernel limits. The variant `split`
is the table's own row (whatever backward it names); `split_bwd` forces the split backward.
Prints ratios cuDNN time / Pallas time (>= 0.8 is the goal), writes the JSON after every variant and ends with
the fastest variant per shape (overall, forward, dq kernel). --budget-s stops starting new variants; --quick: tiny
shapes for a CPU dry run of the same code path (interpret mode, the reference is then the jnp attention and
timings mean nothing).
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

from benchmarks.kernels import bench  # noqa: E402
from pallas_kernels import platform  # noqa: E402

H, KV, D = 8, 2, 128


def _fwd(q, k, warps, stages, **extra):
    return dict(fwd_q=q, fwd_k=k, fwd_warps=warps, fwd_stages=stages, **extra)


def _dkv(q, heads, k, warps, stages):
    return dict(dkv_q=q, dkv_heads=heads, dkv_k=k, dkv_warps=warps, dkv_stages=stages)


def _dq(q, k, warps, stages):
    return dict(dq_q=q, dq_k=k, dq_warps=warps, dq_stages=stages)


# Variant name -> fields replaced in the table's row for the shape (which includes the long-sequence forward).
# split_qXhY fix the dk/dv tiling (dkv_q=X positions x Y stacked heads), dkv_qXhYkKwWsS also its key
# tile, warps and pipeline stages; fwd_qXkYwZsS fix the forward's (query x key tile, warps, pipeline stages),
# dq_qXkYwZsS the dq kernel's. Each keeps the rest of the row.
VARIANTS = {
    "split": {},
    "split_q32h2": dict(dkv_q=32, dkv_heads=2),
    "split_q16h4": dict(dkv_q=16, dkv_heads=4),
    "dkv_q16h4k128w8s2": _dkv(16, 4, 128, 8, 2),
    "dkv_q16h4k128w8s4": _dkv(16, 4, 128, 8, 4),
    "dkv_q16h4k128w4s3": _dkv(16, 4, 128, 4, 3),
    "dkv_q32h4k128w8s3": _dkv(32, 4, 128, 8, 3),
    "dkv_q32h4k128w8s2": _dkv(32, 4, 128, 8, 2),
    "dkv_q16h4k64w4s3": _dkv(16, 4, 64, 4, 3),
    "dkv_q16h2k128w8s3": _dkv(16, 2, 128, 8, 3),
    # dS written as whole tiles by the dk/dv kernel and read back by a one-matmul dq kernel (tiles_dq_* its launch)
    "tiles": dict(bwd="tiles"),
    "tiles_q32h2": dict(bwd="tiles", dkv_q=32, dkv_heads=2),
    "tiles_q16h4": dict(bwd="tiles", dkv_q=16, dkv_heads=4),
    "tiles_q64h1": dict(bwd="tiles", dkv_q=64, dkv_heads=1),
    "tiles_w8": dict(bwd="tiles", tiles_dq_warps=8),
    "tiles_s2": dict(bwd="tiles", tiles_dq_stages=2),
    "tiles_s4": dict(bwd="tiles", tiles_dq_stages=4),
    "tiles_s3": dict(bwd="tiles", tiles_dq_stages=3),
    "split_bwd": dict(bwd="split"),
    # the forward's softmax shift: the running maximum instead of the key-norm bound (table rows use 'bound')
    "fwd_online": dict(fwd_shift="online"),
    # forward tiles (s = pipeline stages; 2-3 programs per SM need <= ~113 KB of shared memory each)
    "fwd_q128k128w8s2": _fwd(128, 128, 8, 2),
    "fwd_q128k128w8s3": _fwd(128, 128, 8, 3),
    "fwd_q128k64w8s2": _fwd(128, 64, 8, 2),
    "fwd_q128k64w8s3": _fwd(128, 64, 8, 3),
    "fwd_q128k32w8s4": _fwd(128, 32, 8, 4),
    "fwd_q64k128w4s3": _fwd(64, 128, 4, 3),
    "fwd_q128k64w8s4": _fwd(128, 64, 8, 4),
    "fwd_q64k64w4s4": _fwd(64, 64, 4, 4),
    "fwd_q64k64w4s2": _fwd(64, 64, 4, 2),
    "fwd_q64k32w4s3": _fwd(64, 32, 4, 3),
    # 256 query rows per K/V tile (half the K/V traffic per flop of 128): 4 warpgroups
    "fwd_q256k64w16s3": _fwd(256, 64, 16, 3),
    "fwd_q256k64w16s2": _fwd(256, 64, 16, 2),
    "fwd_q256k32w16s3": _fwd(256, 32, 16, 3),
    "fwd_q256k64w8s2": _fwd(256, 64, 8, 2),
    # one warpgroup per program and two programs per SM (<= ~113 KB of shared memory each), so that one program's
    # exponentials could overlap the other's matmuls (measured slower at 32k: platform's table notes)
    "fwd_q128k64w4s2": _fwd(128, 64, 4, 2),
    "fwd_q128k32w4s3": _fwd(128, 32, 4, 3),
    "fwd_q128k32w4s2": _fwd(128, 32, 4, 2),
    "fwd_q64k64w4s3": _fwd(64, 64, 4, 3),
    # dq kernel tiles (the table's: q128 k64 w8 s4)
    "dq_q128k128w8s2": _dq(128, 128, 8, 2),
    "dq_q128k64w8s2": _dq(128, 64, 8, 2),
    "dq_q128k64w8s4": _dq(128, 64, 8, 4),
    "dq_q64k128w4s2": _dq(64, 128, 4, 2),
    "dq_q64k128w4s3": _dq(64, 128, 4, 3),
    "dq_q64k64w4s3": _dq(64, 64, 4, 3),
    # one warpgroup per program, two programs per SM (as the forward's w4 variants)
    "dq_q128k32w4s2": _dq(128, 32, 4, 2),
    "dq_q64k64w4s2": _dq(64, 64, 4, 2),
    "dkv_q16h4k64w4s2": _dkv(16, 4, 64, 4, 2),
}


def _rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _key(blocks, prefix: str) -> tuple:
    """The fields of one kernel (forward, dq or dk/dv): variants sharing them share its timing."""
    return tuple(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith(prefix))


class KernelTimer:
    """Seconds of the dq and dk/dv kernels alone (on the table's forward statistics), once per distinct tiling."""

    def __init__(self, B, T, table):
        self.T = T
        self.prob = bench.attention_pass_problem(B, T, H, KV, D, table.clipped(T, T))
        self.flops_fwd = self.prob.flops_fwd
        self.cache = {}

    def __call__(self, phase: str, blocks):
        blocks = blocks.clipped(self.T, self.T)  # the kernels take whole tiles (only --quick shapes are shorter)
        prefixes = ("dkv_", "tiles_") if phase.endswith("_tiles") else (phase + "_",)
        key = (phase, *(_key(blocks, p) for p in prefixes))
        if key not in self.cache:
            self.cache[key] = bench.attempt(bench.time_attention_pass, self.prob, phase, blocks)
        return self.cache[key]


def bench_shape(B, T, variants, ref_impl, deadline, report_row, save):
    q, k, v, do = bench._attention_problem(B, T, H, KV, D)
    table = platform.attention_blocks(D, T)
    report_row["table"] = str(table)
    ref_fwd, ref_fwd_bwd = bench._attention_fns(ref_impl, None)
    t_f, t_fb = bench.time_call(ref_fwd, q, k, v, reps=5, calls=3), bench.time_call(ref_fwd_bwd, q, k, v, do,
                                                                                    reps=5, calls=3)
    ref = ref_fwd_bwd(q, k, v, do)
    ref = (ref[0], *ref[1])
    report_row[ref_impl] = dict(fwd_ms=t_f * 1e3, fwdbwd_ms=t_fb * 1e3)
    print(f"  {ref_impl:13s} B={B} T={T:6d}: fwd {t_f * 1e3:8.3f} ms  fwd+bwd {t_fb * 1e3:8.3f} ms", flush=True)
    save()
    kernels = KernelTimer(B, T, table)
    fwd_ms = {}  # forward time per distinct forward config (the backward options share it)
    for name in variants:
        if time.monotonic() > deadline:
            report_row[name] = dict(skipped="budget")
            continue
        blocks = dataclasses.replace(table, **VARIANTS[name])
        fwd, fwd_bwd = bench._attention_fns("pallas", blocks)
        fwd_key = _key(blocks, "fwd_")
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
        kernel_ms, kernel_tflops = dict(fwd=fwd_ms[fwd_key] * 1e3), {}
        if blocks.bwd in ("split", "tiles"):
            for phase in ("dq", "dkv") if blocks.bwd == "split" else ("dkv_tiles", "dq_tiles"):
                t, kerr = kernels(phase, blocks)
                kernel_ms[phase] = kerr if t is None else t * 1e3
        for phase, ms in kernel_ms.items():
            if isinstance(ms, float):
                kernel_tflops[phase] = kernels.flops_fwd * bench.PASS_FLOPS[phase] / ms / 1e9
        row = dict(blocks=VARIANTS[name], fwd_ms=fwd_ms[fwd_key] * 1e3, fwdbwd_ms=t_fb * 1e3,
                   bwd_ms=(t_fb - fwd_ms[fwd_key]) * 1e3, kernel_ms=kernel_ms, kernel_tflops=kernel_tflops,
                   fwd_vs_ref=t_f / fwd_ms[fwd_key], fwdbwd_vs_ref=report_row[ref_impl]["fwdbwd_ms"] / 1e3 / t_fb,
                   rel_err={n: _rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)})
        report_row[name] = row
        errs = " ".join(f"{n} {e:.1e}" for n, e in row["rel_err"].items())
        kern = " ".join(f"{p} {ms:.3f}" if isinstance(ms, float) else f"{p} failed" for p, ms in kernel_ms.items())
        print(f"  {name:13s} B={B} T={T:6d}: fwd {row['fwd_ms']:8.3f} ms  fwd+bwd {row['fwdbwd_ms']:8.3f} ms "
              f"(bwd {row['bwd_ms']:7.3f})  vs {ref_impl}: fwd {row['fwd_vs_ref']:.3f} fwd+bwd "
              f"{row['fwdbwd_vs_ref']:.3f} | kernels ms: {kern} | err vs {ref_impl}: {errs}", flush=True)
        save()
    report_row["best"] = best_of(report_row)
    save()


def best_of(report_row) -> dict:
    """Fastest variant by fwd+bwd, by forward and by the dq kernel alone (among those that ran)."""
    ran = {n: r for n, r in report_row.items() if n in VARIANTS and isinstance(r, dict) and "fwdbwd_ms" in r}
    best = {}
    for label, score in (("fwdbwd", lambda r: r["fwdbwd_ms"]), ("fwd", lambda r: r["fwd_ms"]),
                         ("dq_kernel", lambda r: r["kernel_ms"].get("dq"))):
        scored = {n: score(r) for n, r in ran.items() if isinstance(score(r), float)}
        if scored:
            name = min(scored, key=scored.get)
            best[label] = dict(variant=name, ms=scored[name], blocks=VARIANTS[name])
    return best


def _parse_shapes(text: str):
    """'4x4096,1x32768' -> ((4, 4096), (1, 32768))."""
    try:
        shapes = tuple(tuple(int(n) for n in item.split("x")) for item in text.split(",") if item)
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes wants comma-separated BxT pairs such as 4x4096,1x32768; got {text!r}")
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attn.json"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    ap.add_argument("--shapes", default="4x4096,1x32768", help="BxT pairs in the order they run")
    ap.add_argument("--budget-s", type=float, default=130.0, help="no new variant starts after this many seconds")
    ap.add_argument("--first-share", type=float, default=0.4,
                    help="fraction of the budget after which the first shape starts no new variant")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU dry run of the code path)")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if not 0 < args.first_share <= 1:
        raise SystemExit(f"--first-share must be in (0, 1], got {args.first_share}")
    t0 = time.monotonic()
    cuda = platform.vendor() == "cuda"
    ref_impl = "cudnn" if cuda else "xla"
    shapes = ((1, 64), (1, 128)) if args.quick else _parse_shapes(args.shapes)
    report = dict(device=bench.device_summary(), H=H, KV=KV, d=D, reference=ref_impl, shapes={})

    def save():
        report["elapsed_s"] = time.monotonic() - t0
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    for i, (B, T) in enumerate(shapes):
        print(f"B={B} T={T}", flush=True)
        report["shapes"][f"T{T}"] = row = dict(B=B, T=T)
        share = args.first_share if i == 0 and len(shapes) > 1 else 1.0
        bench_shape(B, T, variants, ref_impl, t0 + args.budget_s * share, row, save)
        for label, b in row["best"].items():
            print(f"  best {label:9s} T={T}: {b['variant']} {b['ms']:.3f} ms {b['blocks']}", flush=True)
    save()
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s on {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()

"""Muon Newton-Schulz benchmark: `python -m benchmarks.bench_muon [--out FILE] [--batch 8] [--rounds 2] [--no-sweep]`.

One run: the measured bf16 GEMM ceiling; for each matrix shape a sweep of the symmetric kernel's tilings timed on
the whole NS step (the fastest is kept for that shape); then, XLA next to the kernel, the Gram product, one NS step
(XLA as the code runs it, XLA in the earlier a X + B X form, the kernel with and without its fused epilogue) and
the full 5-step NS. Shapes: [2048,2048], [4096,2048], [1024,2048] in stacks of --batch, and a stacked expert leaf
[16,4096,2048]; every one measured --rounds times (--sweep-once: only the first case is swept). Goal (issue 3):
NS step >= 1.3x XLA on 2048x2048. Writes $OUT/muon.json when OUT is set (else benchmarks/results/muon.json); see
benchmarks/kernels/bench_gram.py for what is timed and how FLOPs are counted. H200: about 4 minutes for everything,
under 2 for `--shapes 2048x2048 --stacked 16x4096x2048 --sweep-once`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import warnings

import jax

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from benchmarks.kernels import bench_gram as bench  # noqa: E402 (after the warning filter)
from pallas_kernels import platform  # noqa: E402

SHAPES = [(2048, 2048), (4096, 2048), (1024, 2048)]  # [out, in]: expert down, expert gate_up, q_proj
STACKED = (16, 4096, 2048)  # one layer's expert gate_up leaf, as Muon sees it
SUMMARY_KEYS = ("gram_xla_us", "gram_pallas_us", "step_xla_us", "step_xla_unfolded_us", "step_pallas_us",
                "step_pallas_unfused_us", "ns5_xla_us", "ns5_pallas_us", "gram_speedup", "step_speedup",
                "step_speedup_vs_unfolded", "step_xla_fold_gain", "ns5_speedup", "step_xla_tflops",
                "step_pallas_eff_tflops")


def _dims(text: str):
    return tuple(int(v) for v in text.lower().split("x"))


def _default_out() -> str:
    return os.path.join(os.environ["OUT"], "muon.json") if os.environ.get("OUT") else "benchmarks/results/muon.json"


def _median(rounds, key):
    values = [r[key] for r in rounds if r[key] == r[key]]  # NaN (a failed variant) left out
    return statistics.median(values) if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=_default_out())
    ap.add_argument("--batch", type=int, default=8, help="matrices per call (a stack, as Muon sees experts)")
    ap.add_argument("--rounds", type=int, default=2, help="measure every shape this many times")
    ap.add_argument("--shapes", type=_dims, nargs="*", default=SHAPES, help="e.g. 2048x2048 4096x2048")
    ap.add_argument("--stacked", type=_dims, nargs="*", default=[STACKED], help="BATCHxROWSxCOLS, e.g. 16x4096x2048")
    ap.add_argument("--no-sweep", action="store_true", help="use the default tiling")
    ap.add_argument("--sweep-once", action="store_true",
                    help="sweep the first case only; every other case takes its fastest tiling (saves compiles)")
    ap.add_argument("--ceiling-size", type=int, default=8192, help="n of the n^3 bf16 GEMM ceiling")
    ap.add_argument("--reps", type=int, default=7, help="timing samples per measurement (median)")
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing sample")
    args = ap.parse_args()
    for dims in args.shapes:
        if len(dims) != 2:
            raise SystemExit(f"--shapes takes ROWSxCOLS, got {'x'.join(map(str, dims))}")
    for dims in args.stacked:
        if len(dims) != 3:
            raise SystemExit(f"--stacked takes BATCHxROWSxCOLS, got {'x'.join(map(str, dims))}")
    timing = dict(reps=args.reps, calls=args.calls)
    start = time.perf_counter()
    report = dict(device=str(jax.devices()[0].device_kind), batch=args.batch)

    def log(text):
        print(f"[{time.perf_counter() - start:6.1f}s] {text}", flush=True)

    def save():
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    ceiling = bench.gemm_ceiling_tflops(args.ceiling_size)
    report["gemm_bf16_tflops"] = ceiling
    log(f"{report['device']}: bf16 GEMM ceiling ({args.ceiling_size}^3) {ceiling:.0f} TFLOP/s")
    save()

    cases = [(args.batch, rows, cols) for rows, cols in args.shapes] + list(args.stacked)
    default = bench.default_tiling(jax.numpy.bfloat16)
    tilings = bench.sweep_tilings(platform.compute_units())
    best_for = {}  # iterated matrix shape -> tiling: a stacked leaf reuses the sweep of its matrix shape
    report["shapes"], report["summary"] = [], []
    for batch, rows, cols in cases:
        x = bench.stacked_input(batch, rows, cols)
        matrix = tuple(x.shape[1:])
        label = f"{batch}x{rows}x{cols}"
        if args.no_sweep:
            best_for.setdefault(matrix, default)
        elif args.sweep_once and best_for:
            best_for.setdefault(matrix, next(iter(best_for.values())))
        elif matrix not in best_for:
            sweep = bench.sweep_step(x, tilings, **timing)
            report[f"sweep_{rows}x{cols}"] = sweep
            for r in sweep:
                t = bench.GramTiling(**r["tiling"])
                cfg = (f"tile {t.tile:3d}x{t.cols:<3d} k {t.tile_k:3d} warps {t.num_warps} stages {t.num_stages} "
                       f"tail {t.tail_slots:3d}")
                result = (f"failed: {r['error']}" if "error" in r else
                          f"step {r['step_us']:8.1f} us  {r['step_eff_tflops']:6.0f} TFLOP/s eff  "
                          f"rel err vs XLA {r['step_rel_err_vs_xla']:.1e}")
                log(f"sweep {label}: {cfg}  {result}")
            best_for[matrix] = bench.best_tiling(sweep, default)
            save()
        tiling = best_for[matrix]
        rounds = bench.bench_shape(x, tiling, args.rounds, **timing)
        for m in rounds:
            m.update(shape=[rows, cols], tiling=dataclasses.asdict(tiling))
            report["shapes"].append(m)
            log(f"{label} round {m['round']}: step XLA {m['step_xla_us']:.1f} us (unfolded "
                f"{m['step_xla_unfolded_us']:.1f}), Pallas {m['step_pallas_us']:.1f} (unfused "
                f"{m['step_pallas_unfused_us']:.1f}) -> {m['step_speedup']:.3f}x ({m['step_speedup_vs_unfolded']:.3f}x "
                f"vs unfolded); gram {m['gram_speedup']:.2f}x, NS5 {m['ns5_speedup']:.2f}x; errors "
                f"gram {m['gram_rel_err']:.1e} NS5 {m['ns5_rel_err_vs_xla']:.1e}")
            for key, value in m.items():
                if key.endswith("error") and not key.endswith("rel_err"):
                    log(f"    {key}: {value}")
        summary = dict(case=label, shape=[rows, cols], batch=batch, iterated=list(matrix),
                       tiling=dataclasses.asdict(tiling), **{k: _median(rounds, k) for k in SUMMARY_KEYS})
        report["summary"].append(summary)
        save()
    first = report["summary"][0]
    report["tiling"] = first["tiling"]
    report["goal"] = dict(case=first["case"], step_speedup=first["step_speedup"],
                          step_speedup_vs_unfolded=first["step_speedup_vs_unfolded"], target=1.3,
                          met=first["step_speedup"] >= 1.3)
    save()

    print(f"\nmedians over {args.rounds} rounds; us per call of the whole stack; x = XLA / Pallas; 'vs unf' = XLA "
          f"in the earlier a*X + B*X form / Pallas; bf16 GEMM ceiling {ceiling:.0f} TFLOP/s")
    print(f"{'case':>14} | {'gram XLA':>8} {'Pallas':>8} {'x':>5} | {'step XLA':>8} {'unfold':>8} {'Pallas':>8} "
          f"{'x':>5} {'vs unf':>6} | {'NS5 x':>5} | {'XLA TF/s':>8} {'Pal eff':>7} | tiling")
    for s in report["summary"]:
        t = bench.GramTiling(**s["tiling"])
        print(f"{s['case']:>14} | {s['gram_xla_us']:8.1f} {s['gram_pallas_us']:8.1f} {s['gram_speedup']:5.2f} | "
              f"{s['step_xla_us']:8.1f} {s['step_xla_unfolded_us']:8.1f} {s['step_pallas_us']:8.1f} "
              f"{s['step_speedup']:5.2f} {s['step_speedup_vs_unfolded']:6.2f} | {s['ns5_speedup']:5.2f} | "
              f"{s['step_xla_tflops']:8.0f} {s['step_pallas_eff_tflops']:7.0f} | {t.tile}x{t.cols} k{t.tile_k} "
              f"w{t.num_warps} s{t.num_stages} tail{t.tail_slots}")
    log(f"goal {report['goal']}; wrote {args.out}")


if __name__ == "__main__":
    main()

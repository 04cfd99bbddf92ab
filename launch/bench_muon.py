"""Muon Newton-Schulz benchmark: `python -m launch.bench_muon [--out FILE] [--batch 8] [--rounds 2] [--no-sweep]`.

Prints the measured bf16 GEMM ceiling, a launch-parameter sweep of the symmetric Gram kernel, then for each ZAYA1
matrix shape the Gram product, one Newton-Schulz step and the full 5-step NS, XLA next to the Pallas kernel
(medians; every shape measured `--rounds` times to show the spread). Goal (issue 3): NS step >= 1.3x on 2048x2048.
See pallas_kernels/_bench_gram.py for what is timed and how FLOPs are counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings

import jax

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from pallas_kernels import _bench_gram as bench  # noqa: E402

SHAPES = [(2048, 2048), (4096, 2048), (1024, 2048)]  # [out, in]: expert down, expert gate_up, q_proj


def _shape(text: str):
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/muon.json")
    ap.add_argument("--batch", type=int, default=8, help="matrices per call (a stack, as Muon sees experts)")
    ap.add_argument("--rounds", type=int, default=2, help="measure every shape this many times")
    ap.add_argument("--shapes", type=_shape, nargs="*", default=SHAPES, help="e.g. 2048x2048 4096x2048")
    ap.add_argument("--no-sweep", action="store_true", help="use the default tiling")
    ap.add_argument("--ceiling-size", type=int, default=8192, help="n of the n^3 bf16 GEMM ceiling")
    args = ap.parse_args()
    report = dict(device=str(jax.devices()[0].device_kind), batch=args.batch)

    def save():
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    ceiling = bench.gemm_ceiling_tflops(args.ceiling_size)
    report["gemm_bf16_tflops"] = ceiling
    print(f"{report['device']}: bf16 GEMM ceiling ({args.ceiling_size}^3) {ceiling:.0f} TFLOP/s", flush=True)
    save()

    tiling = bench.default_tiling(jax.numpy.bfloat16)
    if not args.no_sweep:
        rows0, cols0 = args.shapes[0]
        sweep = bench.sweep_tilings(bench.stacked_input(args.batch, rows0, cols0))
        report[f"sweep_{rows0}x{cols0}"] = sweep
        print(f"Gram tiling sweep on a stack of {args.batch} {rows0}x{cols0} (effective TFLOP/s = full 2m^2k / time):")
        for r in sweep:
            t = r["tiling"]
            cfg = f"tile {t['tile']:3d} k {t['tile_k']:3d} warps {t['num_warps']} stages {t['num_stages']}"
            if "error" in r:
                print(f"  {cfg}  failed: {r['error']}")
            else:
                print(f"  {cfg}  {r['us']:8.1f} us  {r['eff_tflops']:6.0f} TFLOP/s  rel err {r['rel_err']:.1e}")
        best = next((r for r in sweep if "us" in r), None)
        if best is not None:
            tiling = bench.GramTiling(**best["tiling"])
        save()
    report["tiling"] = dataclasses.asdict(tiling)

    report["shapes"] = []
    head = (f"{'shape':>10} {'round':>5} | {'gram XLA':>9} {'Pallas':>8} {'all-tiles':>9} {'x':>5} | "
            f"{'step XLA':>9} {'Pallas':>8} {'unfused':>8} {'x':>5} | {'NS5 XLA':>8} {'Pallas':>8} {'x':>5} | "
            f"{'XLA TF/s':>8} {'Pal eff':>7} | err")
    rows = []
    for rows_, cols in args.shapes:
        for m in bench.bench_shape(rows_, cols, args.batch, tiling, args.rounds):
            report["shapes"].append(m)
            save()
            rows.append(f"{rows_:>5}x{cols:<4} {m['round']:>5} | {m['gram_xla_us']:9.1f} {m['gram_pallas_us']:8.1f} "
                        f"{m['gram_pallas_all_tiles_us']:9.1f} {m['gram_speedup']:5.2f} | {m['step_xla_us']:9.1f} "
                        f"{m['step_pallas_us']:8.1f} {m['step_pallas_unfused_us']:8.1f} {m['step_speedup']:5.2f} | "
                        f"{m['ns5_xla_us'] / 1e3:8.3f} "
                        f"{m['ns5_pallas_us'] / 1e3:8.3f} {m['ns5_speedup']:5.2f} | {m['step_xla_tflops']:8.0f} "
                        f"{m['step_pallas_eff_tflops']:7.0f} | {m['gram_rel_err']:.0e} {m['ns5_rel_err_vs_xla']:.0e}")
            print(rows[-1], flush=True)
            for key, value in m.items():
                if key.endswith("error") and not key.endswith("rel_err"):
                    print(f"    {key}: {value}", flush=True)
    print(f"\nper call: a stack of {args.batch} matrices; gram/step in us, NS5 in ms; x = XLA time / Pallas time; "
          f"'all-tiles' = the kernel computing every tile (plain GEMM), 'unfused' = NS step without the b*A + c*A*A "
          f"epilogue; TF/s of the NS step (Pallas: effective); err = Gram vs fp32, NS5 Pallas vs XLA; bf16 GEMM "
          f"ceiling {ceiling:.0f} TFLOP/s; tiling {tiling}")
    print(head)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

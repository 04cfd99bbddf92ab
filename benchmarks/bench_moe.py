"""MoE expert benchmark: `python -m benchmarks.bench_moe [--out FILE] [--quick] [--no-sweep]`.

On the bench shapes (8192 tokens, D = I = 2048, 16 experts, top-1, ~5% skip, bf16) it
  1. measures the bf16 GEMM ceiling (benchmarks.kernels.bench),
  2. sweeps tiles / warps / stages of the three grouped kernels alone (forward, dgrad, wgrad; summed over the
     gate_up and down GEMMs) and keeps the fastest of each,
  3. times the whole SwiGLU expert block, forward and forward + backward: moe 'pallas' (default tiling and the
     sweep's best), 'ragged' (lax.ragged_dot), a dense GEMM of the same useful FLOPs (the ceiling), and on NVIDIA
     'ragged' again under XLA's cuDNN ragged-dot fusion (a subprocess: the flag must be set before jax starts),
  4. checks the Pallas block against 'ragged' (output and gradients) on the same inputs,
and writes everything to a JSON file with a `ratios` summary. See benchmarks/kernels/bench_grouped.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from benchmarks.kernels import bench
from benchmarks.kernels import bench_grouped as moe
from pallas_kernels import platform
from pallas_kernels.grouped_matmul import default_tiling

RAGGED_FUSION_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"

# H200 candidates around the defaults (64-row units in 128-row program tiles; see GroupedTiling). Shared memory per
# stage is (rows + cols) * k * 2 bytes: the largest here (256 x 64 x 4 stages, 128 x 128 x 3) stay under 227 KB.
FWD_CFGS = [dict(),
            dict(fwd_warps=4, fwd_stages=4),
            dict(fwd_n=256, fwd_k=64, fwd_warps=8, fwd_stages=3),
            dict(fwd_n=256, fwd_k=64, fwd_warps=8, fwd_stages=4),
            dict(fwd_n=128, fwd_k=128, fwd_warps=8, fwd_stages=3),
            dict(group_rows=16),
            dict(block_rows=128),  # whole 128-row units: no short last tile, twice the padding
            # 64-row program tiles (every tile short) measured slower than 128-row ones: forward 0.41-0.42 against
            # 0.38-0.39 ms (docs/experiments.md, MoE)
            dict(program_rows=64, fwd_warps=4, fwd_stages=4),
            dict(program_rows=64, fwd_n=256, fwd_k=128, fwd_warps=8, fwd_stages=3)]
DGRAD_CFGS = [dict(),
              dict(dgrad_warps=4, dgrad_stages=4),
              dict(dgrad_n=256, dgrad_k=64, dgrad_warps=8, dgrad_stages=3),
              dict(dgrad_n=128, dgrad_k=128, dgrad_warps=8, dgrad_stages=3),
              dict(dgrad_warps=4, dgrad_stages=3),
              dict(dgrad_n=256, dgrad_k=64, dgrad_warps=8, dgrad_stages=4)]
WGRAD_CFGS = [dict(),
              dict(wgrad_rows=32, wgrad_stages=4),
              dict(wgrad_n=128, wgrad_k=256, wgrad_rows=64, wgrad_warps=8, wgrad_stages=3),
              dict(wgrad_n=256, wgrad_k=128, wgrad_rows=64, wgrad_warps=8, wgrad_stages=3),
              dict(wgrad_warps=4, wgrad_stages=3),
              # one contraction step per 128-row tile: half the loop steps of the default on ~4-tile experts
              dict(wgrad_rows=128, wgrad_stages=2),
              dict(wgrad_rows=128, wgrad_stages=3),
              dict(wgrad_rows=128, wgrad_k=64, wgrad_stages=3)]
# the summed wgrad kernel (k microbatches' loops per program) around the wgrad defaults
WGRAD_SUM_CFGS = [dict(wgrad_rows=128, wgrad_stages=3),
                  dict(wgrad_n=256, wgrad_k=128),
                  dict(wgrad_stages=4, wgrad_rows=32),
                  dict(wgrad_warps=4),
                  dict(wgrad_n=128, wgrad_k=128, wgrad_stages=4)]
# --quick / the CPU (interpret mode): two small launches per kernel exercise the same code path
QUICK_FWD = [dict(), dict(fwd_n=32)]
QUICK_DGRAD = [dict(), dict(dgrad_k=32)]
QUICK_WGRAD = [dict(), dict(wgrad_n=32)]


def _problem(quick: bool) -> moe.MoEProblem:
    if quick:
        return moe.MoEProblem(tokens=512, hidden=64, intermediate=64, experts=4)
    return moe.MoEProblem()


def ragged_fusion_child(out_path: str, quick: bool):
    """Runs inside the subprocess started with the cuDNN ragged-dot flag: times 'ragged' and records whether XLA
    actually emitted a cuDNN fusion for it."""
    p = _problem(quick)
    arrays = moe.make_arrays(p)
    routed = moe.routed_tokens(arrays, p)
    fwd, fwd_bwd = moe.block_fns("ragged")
    result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""))
    for name, fn in (("fwd", fwd), ("fwdbwd", fwd_bwd)):
        hlo = fn.lower(arrays).compile().as_text().lower()
        result[f"{name}_hlo_mentions_cudnn"] = "cudnn" in hlo
    result.update(moe.time_block(fwd, fwd_bwd, arrays, routed, p))
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_ragged_fusion(quick: bool, timeout_s: int = 180) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {RAGGED_FUSION_FLAG}".strip()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ragged_fusion.json")
        cmd = [sys.executable, "-m", "benchmarks.bench_moe", "--ragged-fusion-child", path] + (["--quick"] if quick else [])
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return dict(error=f"timed out after {timeout_s} s")
        if proc.returncode != 0 or not os.path.exists(path):
            return dict(error=f"exit {proc.returncode}: {proc.stderr[-600:]}")
        with open(path) as f:
            return json.load(f)


def _print_block(name: str, r: dict):
    if "error" in r:
        print(f"  {name:22s} error: {r['error'][:300]}", flush=True)
        return
    print(f"  {name:22s} fwd {r['fwd_ms']:7.3f} ms {r['fwd_tflops']:6.1f} TF/s | fwd+bwd {r['fwdbwd_ms']:7.3f} ms "
          f"{r['fwdbwd_tflops']:6.1f} TF/s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/moe.json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test; also what the CPU can run)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the kernel launch sweeps")
    ap.add_argument("--wgrad-sum", type=int, default=4, metavar="K",
                    help="microbatches whose expert gradients are summed (per-microbatch kernels vs one; 0: skip)")
    ap.add_argument("--only-wgrad-sum", action="store_true", help="run only that comparison")
    ap.add_argument("--ragged-fusion-child", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ragged_fusion_child:
        ragged_fusion_child(args.ragged_fusion_child, args.quick)
        return
    t_start = time.time()
    vendor = platform.vendor()
    quick = args.quick or vendor == "cpu"
    p = _problem(quick)
    arrays = moe.make_arrays(p)
    routed = moe.routed_tokens(arrays, p)
    index = np.asarray(arrays["index"])
    sizes = np.bincount(index, minlength=p.experts + 1)
    base = default_tiling(jnp.bfloat16)
    report = dict(device=bench.device_summary(), problem=dict(
        dataclasses.asdict(p), routed_tokens=routed, group_sizes=sizes[:p.experts].tolist(), skip_tokens=int(sizes[-1]),
        padded_units_used=int(np.sum(-(-sizes[:p.experts] // base.block_rows))), block_rows=base.block_rows))

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    print(f"problem: {p}, routed {routed}, group sizes {sizes[:p.experts].tolist()}", flush=True)
    print("ceiling", flush=True)
    gemm = bench.gemm_ceiling_tflops(1024 if quick else 8192)
    report["ceilings"] = dict(gemm_bf16_tflops=gemm)
    print(f"  bf16 GEMM {gemm:.0f} TFLOP/s", flush=True)
    save()

    if args.wgrad_sum:
        print(f"expert gradients of {args.wgrad_sum} microbatches into an fp32 total", flush=True)
        report["wgrad_sum"] = dict(parts=args.wgrad_sum, **moe.time_wgrad_sum(
            p, base, args.wgrad_sum, sweep=QUICK_WGRAD if quick else WGRAD_SUM_CFGS))
        for name, r in report["wgrad_sum"].items():
            if isinstance(r, dict):
                print(f"  {name:8s} per microbatch {r['per_microbatch_ms']:.3f} ms, summed {r['summed_ms']:.3f} ms "
                      f"({r['speedup']:.2f}x), rel diff {r['rel_diff']:.1e}", flush=True)
                for row in r["summed_sweep"]:
                    print(f"    summed {row}", flush=True)
        save()
        if args.only_wgrad_sum:
            return

    best = base
    if not args.no_sweep:
        print("sweeps (each kernel alone, gate_up + down GEMMs)", flush=True)
        cfgs = (QUICK_FWD, QUICK_DGRAD, QUICK_WGRAD) if quick else (FWD_CFGS, DGRAD_CFGS, WGRAD_CFGS)
        report["sweep"] = {}
        for phase, phase_cfgs in zip(("fwd", "dgrad", "wgrad"), cfgs):
            table, best = moe.sweep_phase(phase, phase_cfgs, best, p, index, routed)
            report["sweep"][phase] = table
            save()
        report["sweep"]["best"] = dataclasses.asdict(best)
        print(f"  best {best}  ({time.time() - t_start:.0f} s)", flush=True)

    print("expert block (SwiGLU, weight, skip)", flush=True)
    blocks = {}
    impls = [("pallas", "pallas", base)] + ([("pallas_tuned", "pallas", best)] if best != base else [])
    impls += [("ragged", "ragged", None)]
    for name, impl, tiling in impls:
        blocks[name] = moe.time_block(*moe.block_fns(impl, tiling), arrays, routed, p)
        _print_block(name, blocks[name])
    blocks["dense_gemm"] = moe.time_block(*moe.dense_fns(routed), arrays, routed, p)
    _print_block("dense_gemm", blocks["dense_gemm"])
    report["block"] = blocks
    save()
    if vendor == "cuda" or quick:  # the cuDNN fusion exists on NVIDIA only; --quick dry-runs the subprocess path
        print("ragged under --xla_gpu_experimental_use_ragged_dot_fusion (subprocess)", flush=True)
        blocks["ragged_cudnn_fusion"] = run_ragged_fusion(quick)
        _print_block("ragged_cudnn_fusion", blocks["ragged_cudnn_fusion"])
        save()

    print("parity: pallas block vs ragged (relative errors, bf16)", flush=True)
    report["parity_vs_ragged"] = moe.parity(arrays, best)
    print("  " + ", ".join(f"{k} {v:.1e}" for k, v in report["parity_vs_ragged"].items()), flush=True)

    fastest = "pallas_tuned" if "pallas_tuned" in blocks else "pallas"
    pal = blocks[fastest]

    def ratio(other: str, phase: str):
        o = blocks.get(other, {})
        return o[f"{phase}_ms"] / pal[f"{phase}_ms"] if f"{phase}_ms" in o else None

    report["ratios"] = dict(
        pallas_used=fastest,
        pallas_fwd_speedup_vs_ragged=ratio("ragged", "fwd"),
        pallas_fwdbwd_speedup_vs_ragged=ratio("ragged", "fwdbwd"),
        pallas_fwd_speedup_vs_ragged_cudnn=ratio("ragged_cudnn_fusion", "fwd"),
        pallas_fwdbwd_speedup_vs_ragged_cudnn=ratio("ragged_cudnn_fusion", "fwdbwd"),
        pallas_fwd_fraction_of_dense=pal["fwd_tflops"] / blocks["dense_gemm"]["fwd_tflops"],
        pallas_fwdbwd_fraction_of_dense=pal["fwdbwd_tflops"] / blocks["dense_gemm"]["fwdbwd_tflops"],
        pallas_fwdbwd_fraction_of_gemm_ceiling=pal["fwdbwd_tflops"] / gemm,
        seconds=time.time() - t_start)
    save()
    print("ratios", flush=True)
    for key, val in report["ratios"].items():
        print(f"  {key:40s} {val if isinstance(val, str) or val is None else f'{val:.3f}'}")
    print(f"wrote {args.out} on {jax.devices()[0].device_kind} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()

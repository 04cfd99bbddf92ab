"""Kernel benchmark: `python -m benchmarks.bench_kernels [--out FILE] [--quick] [--no-sweep] [--parts ...]`.

Measures the bf16 GEMM and copy-bandwidth ceilings, sweeps the launch parameters of the fused norm and the
attention kernels (to guide the per-platform tables in pallas_kernels/platform.py), then times norms, attention,
CCA's depthwise convolution and its QK norm + RoPE with the library defaults (Pallas vs XLA, and cuDNN on NVIDIA)
at ZAYA1 shapes and writes everything to a JSON file with a `ratios` summary (of the parts that ran). See benchmarks/kernels/bench.py for
how timings are taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings

import jax

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from benchmarks.kernels import bench
from pallas_kernels import platform
from pallas_kernels.platform import NormLaunch

FWD_CFGS = [dict(fwd_q=128, fwd_k=64, fwd_warps=8, fwd_stages=3), dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=2)]
DQ_CFGS = [dict(dq_q=128, dq_k=64, dq_warps=8, dq_stages=3), dict(dq_q=128, dq_k=64, dq_warps=8, dq_stages=2)]
DKV_CFGS = [dict(dkv_q=32, dkv_k=128, dkv_warps=8, dkv_stages=3, dkv_split=0),
            dict(dkv_q=32, dkv_k=128, dkv_warps=8, dkv_stages=3, dkv_split=1),
            dict(dkv_q=16, dkv_k=128, dkv_warps=8, dkv_stages=3, dkv_split=0),
            dict(dkv_q=32, dkv_k=128, dkv_warps=8, dkv_stages=2, dkv_split=0)]
NORM_FWD = [NormLaunch(1, 8, 4), NormLaunch(1, 16, 2), NormLaunch(2, 16, 2), NormLaunch(1, 8, 8)]
NORM_BWD = [NormLaunch(1, 16, 1), NormLaunch(1, 16, 2), NormLaunch(1, 8, 4)]
# CCA q/k mixing tiles: (head rows, forward warps, backward (A) warps and stages), (depthwise backward rows, warps)
CONV_TILES = [((64, 4, 8, 2), (64, 8)), ((64, 4, 4, 2), (64, 8)), ((64, 4, 8, 3), (64, 8)), ((64, 4, 8, 1), (128, 8)),
              ((128, 4, 8, 2), (64, 8)),
              # then backward (A) programs per compute unit (default 2): more programs, fewer row tiles each
              ((64, 4, 8, 1), (64, 8), 4), ((64, 4, 8, 1), (64, 8), 8), ((64, 4, 8, 2), (64, 8), 8)]
# QK norm + RoPE kernel: (positions per program, warps)
QK_TILES = [(32, 4), (64, 4), (128, 4), (64, 8), (128, 8)]
PARTS = ("norms", "attention", "cca_conv", "qk_norm_rope")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    ap.add_argument("--quick", action="store_true", help="small shapes only (smoke test)")
    ap.add_argument("--no-sweep", action="store_true", help="use the built-in launch parameters")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts: expected a comma list of {PARTS}, got {args.parts!r}")
    cuda = platform.vendor() == "cuda"
    report = dict(device=bench.device_summary())

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    print("ceilings", flush=True)
    copy = bench.copy_ceiling_tbps(2 ** 28 if args.quick else 2 ** 30)
    gemm = bench.gemm_ceiling_tflops(2048 if args.quick else 8192)
    report["ceilings"] = dict(copy_tbps=copy, gemm_bf16_tflops=gemm)
    print(f"  copy {copy:.2f} TB/s, bf16 GEMM {gemm:.0f} TFLOP/s", flush=True)
    save()

    d_model = 2048
    attn_blocks = platform.attention_blocks(128)
    if not args.no_sweep and "norms" in parts and "attention" in parts:
        print("sweeps", flush=True)
        rows = 4096 if args.quick else 16384
        table, best_fwd, best_bwd = bench.sweep_norm_launch(rows, d_model, NORM_FWD, NORM_BWD)
        report["sweep_norm"] = dict(table, rows=rows, d=d_model, best_fwd=dataclasses.asdict(best_fwd),
                                    best_bwd=dataclasses.asdict(best_bwd))
        print(f"  norm best fwd {best_fwd}, bwd {best_bwd}", flush=True)
        B, T = (1, 1024) if args.quick else (4, 4096)
        results, best = bench.sweep_attention_blocks(B, T, 8, 2, 128, FWD_CFGS, DQ_CFGS, DKV_CFGS, attn_blocks)
        report["sweep_attention"] = dict(results, shape=dict(B=B, T=T, H=8, KV=2, d=128),
                                         best=dataclasses.asdict(best))
        print(f"  attention best {best}", flush=True)
        save()

    ratios = {}
    if "norms" in parts:
        print("norms", flush=True)
        norm_shapes = [(2048, d_model)] if args.quick else [(8192, d_model), (16384, d_model)]
        report["norms"] = bench.bench_norms(norm_shapes, copy)
        report["norm_launch_used"] = dict(fwd=dataclasses.asdict(platform.norm_launch(d_model, "fwd")),
                                          bwd=dataclasses.asdict(platform.norm_launch(d_model, "bwd")))
        big_norm = [e for e in report["norms"] if e["kind"] == "merge_rms_norm"][-1]
        ratios.update(rmsnorm_vs_copy_bandwidth=big_norm["pallas_fwdbwd_vs_copy"],
                      rmsnorm_fwdbwd_vs_xla=big_norm["fwdbwd_speedup_vs_xla"],
                      rmsnorm_fwd_vs_copy_bandwidth=big_norm["pallas_fwd_vs_copy"])
        save()

    if "attention" in parts:
        print("attention", flush=True)
        attn_shapes = [(1, 1024, 8, 2, 128)] if args.quick else [(4, 4096, 8, 2, 128), (2, 4096, 8, 2, 128),
                                                                   (1, 32768, 8, 2, 128)]

        def impls_for(T):
            impls = ["pallas"] + (["pallas_positions"] if T == 4096 else []) + (["cudnn"] if cuda else [])
            return impls + (["xla"] if T <= 8192 else [])  # the reference materialises [B, H, T, T] fp32 scores

        report["attention"] = bench.bench_attention(attn_shapes, impls_for)  # each entry records its tiles
        main_attn, long_attn = report["attention"][0], report["attention"][-1]
        ratios.update(
            attention_fwd_vs_xla=main_attn.get("pallas_fwd_vs_xla"),
            attention_fwdbwd_vs_xla=main_attn.get("pallas_fwdbwd_vs_xla"),
            attention_fwd_vs_cudnn=main_attn.get("pallas_fwd_vs_cudnn"),
            attention_fwdbwd_vs_cudnn=main_attn.get("pallas_fwdbwd_vs_cudnn"),
            attention_long_fwdbwd_vs_cudnn=long_attn.get("pallas_fwdbwd_vs_cudnn"),
            attention_fwdbwd_tflops_vs_gemm=main_attn["pallas_fwdbwd_tflops"] / gemm,
        )
        save()

    if "cca_conv" in parts:  # ZAYA1's CCA heads: 8 query + 2 key heads of 128 channels
        print("cca q/k mixing", flush=True)
        conv_shapes = ([(1, 128, 2, 1, 64, True)] if args.quick
                       else [(2, 4096, 8, 2, 128, False), (2, 4096, 8, 2, 128, True)])
        report["cca_conv"] = bench.bench_cca_conv(conv_shapes[:1], copy, sweep=() if args.no_sweep else CONV_TILES)
        report["cca_conv"] += bench.bench_cca_conv(conv_shapes[1:], copy)
        ratios.update(cca_conv_fwdbwd_vs_xla=report["cca_conv"][0]["fwdbwd_speedup_vs_xla"],
                      cca_conv_fwdbwd_vs_copy_bandwidth=report["cca_conv"][0]["pallas_fwdbwd_vs_copy"])
    if "qk_norm_rope" in parts:  # scoring (32 x 1024), training (2 x 4096), decode at batch 64 and 1
        print("cca qk norm + rope", flush=True)
        qk_shapes = [(B, T, 8, 2, 128, 32) for B, T in ([(1, 64)] if args.quick else
                                                         [(32, 1024), (2, 4096), (64, 1), (1, 1)])]
        report["qk_norm_rope"] = bench.bench_qk_norm_rope(qk_shapes, copy, sweep=() if args.no_sweep else QK_TILES)
        ratios.update(qk_norm_rope_fwd_vs_xla=report["qk_norm_rope"][0]["fwd_speedup_vs_xla"],
                      qk_norm_rope_decode_b1_fwd_vs_xla=report["qk_norm_rope"][-1]["fwd_speedup_vs_xla"])
        save()
    report["ratios"] = ratios
    save()
    print("ratios", flush=True)
    for key, val in ratios.items():
        print(f"  {key:34s} {'-' if val is None else f'{val:.3f}'}")
    print(f"wrote {args.out} on {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()

"""The experts' forward stage by stage, unfused (moe_impl 'pallas') against fused ('fused',
pallas_kernels/expert_forward.py), on one problem, with launch variants of the two fused kernels:

    python -m benchmarks.bench_expert_forward [--tokens 32768] [--out FILE.json]

Unfused: the gather into the tile layout, the gate/up grouped GEMM, SwiGLU, the down grouped GEMM, the gather back
times the routing weight. Fused: the up kernel (gather in, SwiGLU out; also on the gathered rows, to split the
gather's cost from the SwiGLU's) and the down kernel (scatter with the weight into a zeroed buffer). Each stage is timed alone on the same inputs (benchmarks.kernels.bench.time_call medians)
next to the bf16 GEMM ceiling of the same run; the layout itself is shared and timed once. Default shapes: ZAYA1's
widths (D = I = 2048, 16 experts) at a scoring call's 32 x 1024 tokens per layer."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from benchmarks.kernels import bench
from benchmarks.kernels import bench_grouped as moe
from pallas_kernels import expert_forward as fused
from pallas_kernels import platform
from pallas_kernels.grouped_matmul import default_tiling, grouped_matmul, program_tiles, units_per_tile
from zaya_jax.model.base import activation
from zaya_jax.model.experts import expert_block
from zaya_jax.ops import grouped_matmul as gmm

VARIANTS = [dict(fwd_stages=3)]


def stages(a, t, act):
    """name -> (jitted fn, its arguments): every stage of both paths on the same layout."""
    E = a["w_gu"].shape[0]
    lay = gmm.tile_layout(a["index"], E, t.block_rows)
    bm = t.block_rows
    tiles = program_tiles(lay.tile_group, E, units_per_tile(t, bm))
    weight = jnp.where(a["index"] < E, a["weight"], 0.0).astype(a["x"].dtype)
    xs = gmm.gather_rows(a["x"], lay.src, lay.dst)
    gu = grouped_matmul(xs, a["w_gu"], lay.tile_group, tiling=t)
    h = act(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]
    y = grouped_matmul(h, a["w_down"], lay.tile_group, tiling=t)
    interpret = platform.interpret()
    n = a["x"].shape[0]
    return {
        "layout": (jax.jit(lambda i: gmm.tile_layout(i, E, bm)), (a["index"],)),
        "gather_in": (jax.jit(lambda x: gmm.gather_rows(x, lay.src, lay.dst)), (a["x"],)),
        "gemm_gate_up": (jax.jit(lambda x: grouped_matmul(x, a["w_gu"], lay.tile_group, tiling=t)), (xs,)),
        "swiglu": (jax.jit(lambda g: act(g[:, :g.shape[1] // 2]) * g[:, g.shape[1] // 2:]), (gu,)),
        "gemm_down": (jax.jit(lambda h: grouped_matmul(h, a["w_down"], lay.tile_group, tiling=t)), (h,)),
        "gather_out_weight": (jax.jit(lambda y: gmm.gather_rows(y, lay.dst, lay.src) * weight[:, None]), (y,)),
        "fused_up_swiglu": (jax.jit(lambda x: fused.up_swiglu(x, lay.src, tiles, a["w_gu"], act, t, bm, interpret)),
                            (a["x"],)),
        "fused_up_swiglu_no_gather": (jax.jit(lambda x: fused.up_swiglu(
            x, jnp.arange(x.shape[0], dtype=jnp.int32), tiles, a["w_gu"], act, t, bm, interpret)), (xs,)),
        "fused_down_scatter": (jax.jit(lambda h: fused.down_scatter(h, lay.src, tiles, weight, a["w_down"], n, t, bm,
                                                                    interpret)), (h,)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quick = platform.vendor() == "cpu"
    p = moe.MoEProblem(tokens=512, hidden=64, intermediate=64, experts=4) if quick else moe.MoEProblem(
        tokens=args.tokens)
    a = moe.make_arrays(p)
    act = activation("silu")
    base = default_tiling(a["x"].dtype)
    gemm = bench.gemm_ceiling_tflops(1024 if quick else 8192)
    report = dict(device=bench.device_summary(), problem=dataclasses.asdict(p), gemm_bf16_tflops=gemm, stages_us={})
    print(f"{p}; bf16 GEMM ceiling {gemm:.0f} TFLOP/s", flush=True)
    for name, (fn, fargs) in stages(a, base, act).items():
        report["stages_us"][name] = round(bench.time_call(fn, *fargs) * 1e6, 1)
        print(f"  {name:20s} {report['stages_us'][name]:9.1f} us", flush=True)
    s = report["stages_us"]
    unfused = sum(s[k] for k in ("gather_in", "gemm_gate_up", "swiglu", "gemm_down", "gather_out_weight"))
    together = s["fused_up_swiglu"] + s["fused_down_scatter"]
    block = {impl: round(bench.time_call(jax.jit(lambda a, impl=impl: expert_block(
        a["x"], a["index"], a["weight"], a["w_gu"], a["w_down"], act, impl=impl)), a) * 1e6, 1)
        for impl in ("pallas", "fused")}
    report["summary"] = dict(unfused_stages_us=unfused, fused_stages_us=together, block_us=block,
                             block_pallas_over_fused=block["pallas"] / block["fused"],
                             fused_gemm_fraction_of_ceiling=6.0 * moe.routed_tokens(a, p) * p.hidden * p.intermediate
                             / (together * 1e-6) / 1e12 / gemm)
    print(f"  stages: unfused {unfused:.1f} us, fused {together:.1f} us; whole block pallas {block['pallas']} us, "
          f"fused {block['fused']} us", flush=True)
    report["variants"] = []
    for v in [] if quick else VARIANTS:
        t = dataclasses.replace(base, **v)
        st = stages(a, t, act)
        row = dict(v, **{k: round(bench.time_call(st[k][0], *st[k][1]) * 1e6, 1)
                         for k in ("gemm_gate_up", "fused_up_swiglu")})
        report["variants"].append(row)
        print(f"  {row}", flush=True)
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

"""A candidate for the experts' gate/up GEMM with the row gather and SwiGLU inside (not in the library: run it, and
move it into pallas_kernels if it wins):

    python -m benchmarks.kernels.probe_swiglu_epilogue [--tokens 32768] [--out FILE.json]

The fused forward of docs/experiments.md lost because splitting its [rows, 2n] accumulator into gate and up halves
is a layout conversion through shared memory. Here the gate and up rows of w_gu are interleaved once (row 2c = gate
c, 2c + 1 = up c), so each B tile is contiguous and a thread's accumulator holds matching gate / up columns side by
side: reshaped to [rows, n, 2] and unstacked on the last axis, the split stays in registers. Against the unfused
path's gather + grouped GEMM + XLA's SwiGLU on the same layout and inputs, with the GEMM ceiling of the same run; also
on rows already gathered (what the gathered loads cost). Checks the outputs agree."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.kernels import bench
from benchmarks.kernels import bench_grouped as moe
from pallas_kernels import platform
from pallas_kernels._grouped_kernels import swizzled_tile
from pallas_kernels.grouped_matmul import default_tiling, grouped_matmul, program_tiles, units_per_tile
from zaya_jax.model.base import activation
from zaya_jax.ops import grouped_matmul as gmm

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))


def interleave(w_gu):
    """[E, 2I, D] (gate rows then up rows) -> [E, 2I, D] with row 2c = gate c and 2c + 1 = up c."""
    E, two_i, D = w_gu.shape
    return w_gu.reshape(E, 2, two_i // 2, D).transpose(0, 2, 1, 3).reshape(E, two_i, D)


def _kernel(unit_ref, group_ref, units_ref, src_ref, x_ref, w_ref, h_ref, *, bm, span, bn, bk, k_steps, num_tiles,
            num_col_tiles, group_rows, num_groups, num_tokens, act, precision, gathered):
    tile, col = swizzled_tile(pl.program_id(0), num_tiles, num_col_tiles, group_rows)
    g, n = group_ref[tile], units_ref[tile]
    first = pl.multiple_of(unit_ref[tile] * bm, bm)
    w_rows = pl.ds(pl.multiple_of(col * 2 * bn, 2 * bn), 2 * bn)  # bn interleaved gate / up pairs

    def compute(m):
        rows = pl.ds(first, m)
        src = src_ref[rows]
        held = src < num_tokens
        src = jnp.where(held, src, 0)[:, None]

        def step(k, acc):
            ks = pl.multiple_of(k * bk, bk)
            if gathered:
                a = plgpu.load(x_ref.at[src, (ks + jnp.arange(bk))[None, :]], mask=held[:, None], other=0)
            else:  # rows already in the tile layout: plain block loads
                a = x_ref[rows, pl.ds(ks, bk)]
            return acc + lax.dot_general(a, w_ref[g, w_rows, pl.ds(ks, bk)], _NT, precision=precision,
                                         preferred_element_type=F32)

        acc = lax.fori_loop(0, k_steps, step, jnp.zeros((m, 2 * bn), F32))
        gate, up = jnp.unstack(acc.reshape(m, bn, 2), axis=-1)
        dtype = h_ref.dtype
        activated = act(gate.astype(dtype).astype(F32)).astype(dtype)
        h_ref[rows, pl.ds(pl.multiple_of(col * bn, bn), bn)] = (
            activated.astype(F32) * up.astype(dtype).astype(F32)).astype(dtype)

    for u in range(1, span + 1):
        pl.when((n == u) & (g < num_groups))(functools.partial(compute, u * bm))


def up_swiglu(x, src, tiles, w_il, act, t, bm: int, num_tokens: int, gathered: bool = True):
    """h [Np, I] = act(x[src] @ gateᵀ) * (x[src] @ upᵀ) on the tile layout, w_il from `interleave`; with
    gathered=False x is already in the tile layout (src only marks the padding rows)."""
    hidden, inter = x.shape[1], w_il.shape[1] // 2
    bn, bk = min(t.fwd_n // 2, inter), min(t.fwd_k, hidden)
    kernel = functools.partial(_kernel, bm=bm, span=units_per_tile(t, bm), bn=bn, bk=bk, k_steps=hidden // bk,
                               num_tiles=tiles.shape[1], num_col_tiles=inter // bn, group_rows=t.group_rows,
                               num_groups=w_il.shape[0], num_tokens=num_tokens, act=act,
                               precision=platform.dot_precision(x.dtype), gathered=gathered)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((src.shape[0], inter), x.dtype),
                          grid=(tiles.shape[1] * (inter // bn),),
                          compiler_params=platform.compiler_params(t.fwd_warps, t.fwd_stages),
                          interpret=platform.interpret(), name="up_swiglu_interleaved")(
        tiles[0], tiles[1], tiles[2], src, x, w_il)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quick = platform.vendor() == "cpu"
    p = moe.MoEProblem(tokens=300, hidden=64, intermediate=64, experts=4) if quick else moe.MoEProblem(
        tokens=args.tokens)
    a = moe.make_arrays(p)
    act = activation("silu")
    t = default_tiling(a["x"].dtype)
    if quick:  # several column tiles and two-unit program tiles in interpret mode
        t = dataclasses.replace(t, program_rows=32, fwd_n=32)
    bm, E, n = t.block_rows, p.experts, p.tokens
    lay = gmm.tile_layout(a["index"], E, bm)
    tiles = program_tiles(lay.tile_group, E, units_per_tile(t, bm))
    w_il = jax.jit(interleave)(a["w_gu"])
    xs = gmm.gather_rows(a["x"], lay.src, lay.dst)
    gu = grouped_matmul(xs, a["w_gu"], lay.tile_group, tiling=t)
    stages = {
        "gather_in": (jax.jit(lambda x: gmm.gather_rows(x, lay.src, lay.dst)), a["x"]),
        "gemm_gate_up": (jax.jit(lambda x: grouped_matmul(x, a["w_gu"], lay.tile_group, tiling=t)), xs),
        "swiglu": (jax.jit(lambda g: act(g[:, :g.shape[1] // 2]) * g[:, g.shape[1] // 2:]), gu),
        "candidate": (jax.jit(lambda x: up_swiglu(x, lay.src, tiles, w_il, act, t, bm, n)), a["x"]),
        "candidate_on_gathered_rows": (jax.jit(lambda x: up_swiglu(
            x, jnp.arange(x.shape[0], dtype=jnp.int32), tiles, w_il, act, t, bm, x.shape[0])), xs),
        "contiguous_loads_on_gathered_rows": (jax.jit(lambda x: up_swiglu(
            x, jnp.arange(x.shape[0], dtype=jnp.int32), tiles, w_il, act, t, bm, x.shape[0], gathered=False)), xs),
    }
    if not quick:  # launch parameters of the contiguous variant
        for n_stages, n_cols in ((3, 256), (4, 128), (3, 128)):
            tt = dataclasses.replace(t, fwd_stages=n_stages, fwd_n=n_cols)
            stages[f"contiguous_stages{n_stages}_n{n_cols}"] = (jax.jit(lambda x, tt=tt: up_swiglu(
                x, jnp.arange(x.shape[0], dtype=jnp.int32), tiles, w_il, act, tt, bm, x.shape[0], gathered=False)), xs)
    gemm = bench.gemm_ceiling_tflops(1024 if quick else 8192)
    report = dict(device=bench.device_summary(), problem=dataclasses.asdict(p), gemm_bf16_tflops=gemm, us={})
    print(f"{p}; bf16 GEMM ceiling {gemm:.0f} TFLOP/s", flush=True)
    for name, (fn, arg) in stages.items():
        report["us"][name] = round(bench.time_call(fn, arg) * 1e6, 1)
        print(f"  {name:28s} {report['us'][name]:9.1f} us", flush=True)
    want = stages["swiglu"][0](gu).astype(F32)
    busy = jnp.repeat(lay.tile_group < E, bm)  # rows of units past the last expert are not written
    for name in ("candidate", "contiguous_loads_on_gathered_rows"):
        got = stages[name][0](a["x"] if name == "candidate" else xs).astype(F32)
        report[f"max_rel_diff_{name}"] = float(
            jnp.abs(jnp.where(busy[:, None], got - want, 0)).max() / jnp.abs(want).max())
    u = report["us"]
    report["unfused_over_candidate"] = (u["gather_in"] + u["gemm_gate_up"] + u["swiglu"]) / u["candidate"]
    report["unfused_over_gather_then_contiguous"] = (u["gather_in"] + u["gemm_gate_up"] + u["swiglu"]) / (
        u["gather_in"] + u["contiguous_loads_on_gathered_rows"])
    print(f"  unfused / candidate {report['unfused_over_candidate']:.3f}, unfused / (gather + contiguous) "
          f"{report['unfused_over_gather_then_contiguous']:.3f}; max rel diffs "
          f"{report['max_rel_diff_candidate']:.1e} / {report['max_rel_diff_contiguous_loads_on_gathered_rows']:.1e}")
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

"""Where the MoE expert block's time goes on a GPU (moe_impl 'pallas', the bench shapes): every kernel of its forward
and of its forward + backward from a profiler trace, and the tile layout built three ways on the same routing (the
library's one-hot cumsum, a stable argsort, a blocked cumsum by triangular matmuls), each checked equal to the
library's.

python -m benchmarks.probe_expert_block [--tokens 8192,32768] [--out FILE.json]"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import bench
from benchmarks.kernels import bench_grouped as moe
from benchmarks.systems import profile_trace
from zaya_jax.ops import grouped_matmul as gmm


def layout_argsort(index, num_groups: int, block_rows: int) -> gmm.TileLayout:
    n, E, bm = index.shape[0], num_groups, block_rows
    n_pad = gmm.padded_rows(n, E, bm)
    index = jnp.clip(index.astype(jnp.int32), 0, E)
    order = jnp.argsort(index, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(index, length=E + 1)[:E].astype(jnp.int32)
    start = jnp.cumsum(sizes) - sizes
    tiles = -(-sizes // bm)
    tile_end = jnp.cumsum(tiles)
    first_row = (tile_end - tiles) * bm
    tile_group = jnp.searchsorted(tile_end, jnp.arange(n_pad // bm), side="right").astype(jnp.int32)
    g = jnp.minimum(jnp.repeat(tile_group, bm), E - 1)
    r = jnp.arange(n_pad, dtype=jnp.int32) - first_row[g]
    held = (jnp.repeat(tile_group, bm) < E) & (r < sizes[g])
    src = jnp.where(held, order[jnp.clip(start[g] + r, 0, n - 1)], n)
    position = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    e = jnp.minimum(index, E - 1)
    dst = jnp.where(index < E, first_row[e] + position - start[e], n_pad)
    return gmm.TileLayout(src=src.astype(jnp.int32), dst=dst.astype(jnp.int32), tile_group=tile_group)


def layout_blocked(index, num_groups: int, block_rows: int, chunk: int = 256) -> gmm.TileLayout:
    n, E, bm = index.shape[0], num_groups, block_rows
    n_pad = gmm.padded_rows(n, E, bm)
    index = jnp.clip(index.astype(jnp.int32), 0, E)
    m = -(-n // chunk) * chunk
    onehot = jax.nn.one_hot(jnp.pad(index, (0, m - n), constant_values=E), E + 1, dtype=jnp.bfloat16)
    tri = jnp.tril(jnp.ones((chunk, chunk), jnp.bfloat16))
    within = jnp.einsum("ij,bjk->bik", tri, onehot.reshape(-1, chunk, E + 1), preferred_element_type=jnp.float32)
    totals = within[:, -1]
    inclusive = (within + (jnp.cumsum(totals, axis=0) - totals)[:, None]).reshape(m, E + 1)[:n]
    rank = jnp.take_along_axis(inclusive, index[:, None], axis=1)[:, 0].astype(jnp.int32) - 1
    sizes = totals.sum(0)[:E].astype(jnp.int32)
    tiles = -(-sizes // bm)
    tile_end = jnp.cumsum(tiles)
    first_row = (tile_end - tiles) * bm
    routed = index < E
    dst = jnp.where(routed, first_row[jnp.minimum(index, E - 1)] + rank, n_pad).astype(jnp.int32)
    src = jnp.full((n_pad,), n, jnp.int32).at[dst].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    tile_group = jnp.searchsorted(tile_end, jnp.arange(n_pad // bm), side="right").astype(jnp.int32)
    return gmm.TileLayout(src=src, dst=dst, tile_group=tile_group)


LAYOUTS = {"library": gmm.tile_layout, "argsort": layout_argsort, "blocked": layout_blocked}


def kernels(fn, *args, top: int = 25) -> dict:
    logdir = tempfile.mkdtemp(prefix="probe_expert_block_")
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(logdir):
        for _ in range(3):
            out = fn(*args)
        jax.block_until_ready(out)
    ops, _, _ = profile_trace.load(logdir)
    per = collections.defaultdict(float)
    for e in ops:
        if e.plane.startswith("/device"):
            per[e.name] += e.duration_ns / 3e3
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    return dict(kernel_us=round(sum(per.values()), 1), kernels=len(per),
                top=[(name[:90], round(us, 1)) for name, us in rows[:top]])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = dict(device=bench.device_summary(), runs={})
    for tokens in map(int, args.tokens.split(",")):
        p = moe.MoEProblem(tokens=tokens)
        a = moe.make_arrays(p)
        want = gmm.tile_layout(a["index"], p.experts, 64)
        run = report["runs"][tokens] = dict(layout_us={})
        for name, build in LAYOUTS.items():
            fn = jax.jit(lambda i, build=build: build(i, p.experts, 64))
            got = fn(a["index"])
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(got, want))
            run["layout_us"][name] = dict(us=round(bench.time_call(fn, a["index"]) * 1e6, 1), equal=same)
            print(tokens, name, run["layout_us"][name], flush=True)
        fwd, fwd_bwd = moe.block_fns("pallas")
        run["layout_kernels"] = kernels(jax.jit(lambda i: gmm.tile_layout(i, p.experts, 64)), a["index"])
        run["forward"] = kernels(fwd, a)
        run["forward_backward"] = kernels(fwd_bwd, a)
        for key in ("layout_kernels", "forward", "forward_backward"):
            print(tokens, key, json.dumps(run[key], indent=0), flush=True)
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

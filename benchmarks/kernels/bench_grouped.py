"""Measurements behind `python -m benchmarks.bench_moe`: the MoE expert block (Pallas grouped GEMM vs ragged_dot vs a
dense GEMM of the same useful FLOPs) and launch sweeps of the three grouped kernels.

Timing is benchmarks.kernels.bench.time_call (median over repeats of back-to-back calls). FLOPs count useful work
only: 2 * routed tokens * in * out per GEMM (no padding rows, no skip tokens); the SwiGLU block's forward is
6 * routed * D * I, forward + backward 3x that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _grouped_kernels as kern
from pallas_kernels import platform
from benchmarks.kernels.bench import time_call
from pallas_kernels.grouped_matmul import GroupedTiling, group_tiles, grouped_wgrad_sum, program_tiles, units_per_tile
from zaya_jax.model.base import activation, compute_matmul
from zaya_jax.model.experts import expert_block
from zaya_jax.ops import grouped_matmul as gmm

BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    tokens: int = 8192
    hidden: int = 2048  # D
    intermediate: int = 2048  # I (per SwiGLU branch)
    experts: int = 16
    skip_fraction: float = 0.05
    spread: float = 0.3  # log-normal spread of expert popularity (a balanced-but-not-perfect router)
    seed: int = 0


def routing(p: MoEProblem) -> np.ndarray:
    """index [N] in [0, E]: experts drawn from a log-normal popularity, ~skip_fraction to the skip class E."""
    rng = np.random.default_rng(p.seed)
    popularity = np.exp(p.spread * rng.standard_normal(p.experts))
    probs = np.append((1 - p.skip_fraction) * popularity / popularity.sum(), p.skip_fraction)
    return rng.choice(p.experts + 1, size=p.tokens, p=probs).astype(np.int32)


def make_arrays(p: MoEProblem):
    k = jax.random.split(jax.random.key(p.seed), 6)
    D, I, E, N = p.hidden, p.intermediate, p.experts, p.tokens
    return dict(
        x=jax.random.normal(k[0], (N, D), BF16),
        index=jnp.asarray(routing(p)),
        weight=jax.random.uniform(k[1], (N,), jnp.float32, 0.2, 1.0),
        w_gu=(0.02 * jax.random.normal(k[2], (E, 2 * I, D), jnp.float32)).astype(BF16),
        w_down=(0.02 * jax.random.normal(k[3], (E, D, I), jnp.float32)).astype(BF16),
        dy=jax.random.normal(k[4], (N, D), BF16))


def routed_tokens(arrays, p: MoEProblem) -> int:
    return int(jnp.sum(arrays["index"] < p.experts))


def block_flops(routed: int, p: MoEProblem, fwd_bwd: bool) -> float:
    return 6.0 * routed * p.hidden * p.intermediate * (3.0 if fwd_bwd else 1.0)


# --------------------------------------------------------------------------------------------- the expert block
def block_fns(impl: str, tiling: GroupedTiling | None = None):
    """(fwd, fwd+bwd) of the whole SwiGLU expert block as the model runs it (weight and skip included)."""
    act = activation("silu")

    def fwd(a):
        return expert_block(a["x"], a["index"], a["weight"], a["w_gu"], a["w_down"], act, impl=impl, tiling=tiling)

    def fwd_bwd(a):
        def f(x, weight, w_gu, w_down):
            return expert_block(x, a["index"], weight, w_gu, w_down, act, impl=impl, tiling=tiling)
        out, pull = jax.vjp(f, a["x"], a["weight"], a["w_gu"], a["w_down"])
        return out, pull(a["dy"])

    return jax.jit(fwd), jax.jit(fwd_bwd)


def dense_fns(routed: int):
    """The same useful FLOPs as one dense SwiGLU MLP over the routed tokens (expert 0's weights): the ceiling."""
    act = activation("silu")

    def mlp(x, w_gu, w_down):
        gate, up = jnp.split(compute_matmul("nd,od->no", x, w_gu), 2, axis=-1)
        return compute_matmul("ni,di->nd", act(gate) * up, w_down)

    def fwd(a):
        return mlp(a["x"][:routed], a["w_gu"][0], a["w_down"][0])

    def fwd_bwd(a):
        out, pull = jax.vjp(mlp, a["x"][:routed], a["w_gu"][0], a["w_down"][0])
        return out, pull(a["dy"][:routed])

    return jax.jit(fwd), jax.jit(fwd_bwd)


def time_block(fwd, fwd_bwd, arrays, routed: int, p: MoEProblem) -> dict:
    t_f = time_call(fwd, arrays)
    t_fb = time_call(fwd_bwd, arrays, calls=5)
    return dict(fwd_ms=t_f * 1e3, fwdbwd_ms=t_fb * 1e3, fwd_tflops=block_flops(routed, p, False) / t_f / 1e12,
                fwdbwd_tflops=block_flops(routed, p, True) / t_fb / 1e12)


def parity(arrays, tiling: GroupedTiling | None = None) -> dict:
    """Relative errors of the Pallas block against 'ragged' (output and every gradient), on the bench inputs."""
    _, fb_p = block_fns("pallas", tiling)
    _, fb_r = block_fns("ragged")
    (out_p, grads_p), (out_r, grads_r) = fb_p(arrays), fb_r(arrays)

    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))

    names = ("dx", "dweight", "dw_gate_up", "dw_down")
    return dict(out=rel(out_p, out_r), **{n: rel(g, h) for n, g, h in zip(names, grads_p, grads_r)})


# --------------------------------------------------------------------------------------------- kernel sweeps
def _gemm_shapes(p: MoEProblem):
    """(name, in, out) of the block's two grouped GEMMs."""
    return [("gate_up", p.hidden, 2 * p.intermediate), ("down", p.intermediate, p.hidden)]


@functools.lru_cache(maxsize=4)
def _layout(index_key: bytes, n: int, E: int, block_rows: int):
    index = jnp.asarray(np.frombuffer(index_key, np.int32).reshape(n))
    return gmm.tile_layout(index, E, block_rows)


def _kernel_inputs(p: MoEProblem, index: np.ndarray, t: GroupedTiling, d_in: int, d_out: int):
    lay = _layout(index.tobytes(), p.tokens, p.experts, t.block_rows)
    k = jax.random.split(jax.random.key(p.seed + d_in + 7 * d_out), 3)
    x = gmm.gather_rows(jax.random.normal(k[0], (p.tokens, d_in), BF16), lay.src, lay.dst)
    dy = gmm.gather_rows(jax.random.normal(k[1], (p.tokens, d_out), BF16), lay.src, lay.dst)
    w = (0.02 * jax.random.normal(k[2], (p.experts, d_out, d_in), jnp.float32)).astype(BF16)
    start, count = group_tiles(lay.tile_group, p.experts)
    tiles = program_tiles(lay.tile_group, p.experts, units_per_tile(t, t.block_rows))
    return dict(x=x, dy=dy, w=w, tile_group=lay.tile_group, tiles=tiles, start=start, count=count)


def _kernel_fn(phase: str, t: GroupedTiling):
    interpret = platform.interpret()
    if phase == "fwd":
        return jax.jit(lambda a: kern.rows_matmul(
            a["x"], a["w"], a["tiles"], transpose_w=True, block_rows=t.block_rows,
            span=units_per_tile(t, t.block_rows), block_n=t.fwd_n, block_k=t.fwd_k,
            group_rows=t.group_rows, num_warps=t.fwd_warps, num_stages=t.fwd_stages, interpret=interpret))
    if phase == "dgrad":
        return jax.jit(lambda a: kern.rows_matmul(
            a["dy"], a["w"], a["tiles"], transpose_w=False, block_rows=t.block_rows,
            span=units_per_tile(t, t.block_rows), block_n=t.dgrad_n, block_k=t.dgrad_k,
            group_rows=t.group_rows, num_warps=t.dgrad_warps, num_stages=t.dgrad_stages, interpret=interpret))
    return jax.jit(lambda a: kern.group_wgrad(
        [a["dy"]], [a["x"]], a["start"][None], a["count"][None], block_rows=t.block_rows, block_n=t.wgrad_n,
        block_k=t.wgrad_k, rows_step=t.wgrad_rows, num_warps=t.wgrad_warps, num_stages=t.wgrad_stages,
        interpret=interpret))


def sweep_phase(phase: str, cfgs, base: GroupedTiling, p: MoEProblem, index: np.ndarray, routed: int):
    """Times one kernel alone on both GEMM shapes under each config (dicts of GroupedTiling fields); returns the
    table and the base tiling updated with the config of the smallest summed time."""
    table, totals = [], {}
    for cfg in cfgs:
        t = dataclasses.replace(base, **cfg)
        row, total = dict(cfg), 0.0
        try:
            for name, d_in, d_out in _gemm_shapes(p):
                a = _kernel_inputs(p, index, t, d_in, d_out)
                sec = time_call(_kernel_fn(phase, t), a)
                row[f"{name}_ms"] = sec * 1e3
                row[f"{name}_tflops"] = 2.0 * routed * d_in * d_out / sec / 1e12
                total += sec
        except Exception as e:  # noqa: BLE001 - a launch that does not compile (shared memory, registers) is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  {phase:5s} {cfg}: {row['error']}", flush=True)
            table.append(row)
            continue
        row["total_ms"] = total * 1e3
        table.append(row)
        totals[tuple(sorted(cfg.items()))] = total
        print(f"  {phase:5s} {cfg}: gate_up {row['gate_up_ms']:.3f} ms ({row['gate_up_tflops']:.0f} TF/s), down "
              f"{row['down_ms']:.3f} ms ({row['down_tflops']:.0f} TF/s)", flush=True)
    best = dataclasses.replace(base, **dict(min(totals, key=totals.get))) if totals else base
    return table, best


# ------------------------------------------------------------------------------ expert gradients of k microbatches
def time_wgrad_sum(p: MoEProblem, t: GroupedTiling, parts: int, reps: int = 4, sweep=()) -> dict:
    """Both GEMM shapes: the expert weight gradients of `parts` microbatches (each on its own routing) added to an
    fp32 total, as the accumulating train step does, two ways: `per_microbatch` = one wgrad kernel per microbatch
    (gradient in bf16) and one fp32 pass adding them to the total; `summed` = grouped_wgrad_sum (one kernel, one fp32
    register sum, added in place). The total is a loop carry over `reps` updates, as in the step's scan (in-place
    updates); ms per update and the relative difference of the two totals. `sweep`: GroupedTiling field overrides
    of the summed kernel, timed too (`summed_sweep`: its k steps per program make other tiles worth a look)."""
    interpret = platform.interpret()
    out = {}
    for name, d_in, d_out in _gemm_shapes(p):
        ins = [_kernel_inputs(dataclasses.replace(p, seed=p.seed + i), routing(dataclasses.replace(p, seed=p.seed + i)),
                              t, d_in, d_out) for i in range(parts)]
        dys, xs, groups = [a["dy"] for a in ins], [a["x"] for a in ins], [a["tile_group"] for a in ins]
        total = jnp.zeros((p.experts, d_out, d_in), jnp.float32)

        def per_microbatch(total, dys, xs, groups):
            def update(_, total):
                for dy, x, g in zip(dys, xs, groups):
                    start, count = group_tiles(g, p.experts)
                    total = total + kern.group_wgrad(
                        [dy], [x], start[None], count[None], block_rows=t.block_rows, block_n=t.wgrad_n,
                        block_k=t.wgrad_k, rows_step=t.wgrad_rows, num_warps=t.wgrad_warps,
                        num_stages=t.wgrad_stages, interpret=interpret).astype(jnp.float32)
                return total
            return jax.lax.fori_loop(0, reps, update, total)

        def summed(total, dys, xs, groups, tiling=t):
            return jax.lax.fori_loop(
                0, reps, lambda _, tot: grouped_wgrad_sum(tot, dys, xs, groups, tiling=tiling, interpret=interpret),
                total)

        row = {}
        for label, fn in (("per_microbatch", per_microbatch), ("summed", summed)):
            f = jax.jit(fn)
            row[f"{label}_ms"] = time_call(f, total, dys, xs, groups, reps=5, calls=2) / reps * 1e3
            row[f"{label}_total"] = f(total, dys, xs, groups)
        row["summed_sweep"] = []
        for cfg in sweep:
            f = jax.jit(functools.partial(summed, tiling=dataclasses.replace(t, **cfg)))
            try:
                ms = time_call(f, total, dys, xs, groups, reps=5, calls=2) / reps * 1e3
            except Exception as e:  # noqa: BLE001 - a launch that does not compile is a result
                row["summed_sweep"].append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            row["summed_sweep"].append(dict(cfg, ms=ms))
        a, b = (np.asarray(row.pop(f"{k}_total"), np.float64) for k in ("per_microbatch", "summed"))
        row["rel_diff"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        row["speedup"] = row["per_microbatch_ms"] / row["summed_ms"]
        out[name] = row
    return out


__all__ = ["MoEProblem", "block_flops", "block_fns", "dense_fns", "make_arrays", "parity", "routed_tokens",
           "routing", "sweep_phase", "time_block", "time_wgrad_sum"]

"""Measurements behind `python -m benchmarks.bench_muon`: the symmetric Gram kernel and the Newton-Schulz step,
Pallas next to XLA, against the measured bf16 GEMM ceiling.

Timing is benchmarks/kernels/bench.time_call: jit, warm up, then the median over repeats of (back-to-back calls,
block_until_ready) / calls. Each call works on a stack of `batch` matrices (Muon orthogonalises stacks: 16 experts
per layer, 40 layers), so one call lasts far longer than a dispatch. Inputs are fresh random bf16 arrays.

FLOPs are counted as XLA does the work: X Xᵀ for X [m, k] is 2·m²·k, A·A is 2·m³, B·X is 2·m²·k; one NS step
is their sum. The kernel does about (T+1)/(2T) of the first two (T = column blocks per side), so its "effective"
TFLOP/s (full count / time) can exceed what it actually executes.

The NS step is timed in three forms: 'step_xla' (the iteration as the code runs it in XLA: X' = (aI + bA + cA·A) X),
'step_xla_unfolded' (a X + (bA + cA·A) X, the form of the earlier code and of most Muon implementations) and
'step_pallas' (the kernel for A and for aI + bA + cA·A, then the same XLA GEMM). step_speedup is like for like
(step_xla / step_pallas); step_speedup_vs_unfolded compares with the earlier XLA form.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.bench import attempt, gemm_ceiling_tflops, time_call
from pallas_kernels.symmetric_matmul import GramTiling, default_tiling, symmetric_gram
from zaya_jax.ops.newton_schulz import (QUINTIC_COEFFS, apply_left, gram_reference, newton_schulz,
                                        newton_schulz_step, newton_schulz_step_unfolded)

BF16 = jnp.bfloat16

# Focused launch set (H200 sweep of benchmarks/results/muon_h200.json: 128-row tiles with 4 warps led; 64 lost 25%):
# square 128 tiles with short / long k steps, and wide 128 x 256 tiles (more MMA work per byte of shared memory,
# 8 warps hold the 128x256 fp32 accumulator), plus 64-row tiles for the small 1024 side (more programs per wave).
TILINGS = [GramTiling(128, 32, 4, 4), GramTiling(128, 64, 4, 3), GramTiling(128, 64, 8, 3, tile_cols=256),
           GramTiling(128, 32, 8, 4, tile_cols=256), GramTiling(64, 64, 4, 3, tile_cols=128)]


def sweep_tilings(compute_units: int):
    """TILINGS plus deeper pipelines of the wide tile and split-tail variants (GramTiling.tail_slots): the last
    wave's tiles as half-height programs, with the programs resident at once taken as compute_units x (programs
    per SM: 1 for the 128 x 256 tile's 8 warps and >= 147 KB of shared memory, 1 or 2 for the 128 x 128 tile)."""
    wide_k64 = GramTiling(128, 64, 8, 3, tile_cols=256)
    wide_k64_s4 = GramTiling(128, 64, 8, 4, tile_cols=256)  # 196 KB of shared memory: fits 227 KB
    square_k64 = GramTiling(128, 64, 4, 3)
    tails = [dataclasses.replace(wide_k64, tail_slots=compute_units),
             dataclasses.replace(wide_k64_s4, tail_slots=compute_units),
             dataclasses.replace(GramTiling(128, 32, 8, 4, tile_cols=256), tail_slots=compute_units),
             dataclasses.replace(square_k64, tail_slots=2 * compute_units),
             dataclasses.replace(GramTiling(128, 64, 4, 4), tail_slots=compute_units)]
    return TILINGS + [wide_k64_s4, GramTiling(128, 64, 4, 4)] + tails


def stacked_input(batch: int, rows: int, cols: int, seed: int = 0):
    """[batch, m, k] with m = min(rows, cols): the orientation Newton-Schulz iterates in."""
    m, k = min(rows, cols), max(rows, cols)
    x = jax.random.normal(jax.random.key(seed), (batch, m, k), jnp.float32)
    return (x / jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))).astype(BF16)


def gram_flops(x) -> float:
    b, m, k = x.shape
    return 2.0 * b * m * m * k


def ns_step_flops(x) -> float:
    b, m, k = x.shape
    return 2.0 * b * (m * m * k + m**3 + m * m * k)


def ns_step_unfused(x, tiling):
    """The NS step with the kernel for both products but aI + bA + cA·A left to XLA (to measure the epilogue)."""
    a, b, c = QUINTIC_COEFFS
    f32 = jnp.float32
    A = symmetric_gram(x, tiling=tiling)
    B = (a * jnp.eye(A.shape[-1], dtype=f32) + b * A.astype(f32)
         + c * symmetric_gram(A, tiling=tiling).astype(f32)).astype(x.dtype)
    return apply_left(B, x)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _attempt(fn, *args, **timing):
    """(seconds, None) or (nan, 'error text'): a failing tiling or variant is reported, not raised."""
    seconds, error = attempt(time_call, fn, *args, **timing)
    return (float("nan"), error) if error else (seconds, None)


def sweep_step(x, tilings=TILINGS, **timing):
    """Times the Pallas NS step per tiling on x; rows sorted fastest first (failures last, with their error)."""
    want = jax.jit(newton_schulz_step)(x)
    rows = []
    for tiling in tilings:
        fn = jax.jit(lambda x, t=tiling: newton_schulz_step(x, gram_impl="pallas", tiling=t))
        row = dict(tiling=dataclasses.asdict(tiling))
        seconds, error = _attempt(fn, x, **timing)
        if error:
            row["error"] = error
        else:
            row.update(step_us=seconds * 1e6, step_rel_err_vs_xla=rel_err(fn(x), want),
                       step_eff_tflops=ns_step_flops(x) / seconds / 1e12)
        rows.append(row)
    return sorted(rows, key=lambda r: r.get("step_us", float("inf")))


def best_tiling(sweep, fallback: GramTiling) -> GramTiling:
    best = next((r for r in sweep if "step_us" in r), None)
    return GramTiling(**best["tiling"]) if best else fallback


def bench_shape(x, tiling: GramTiling, rounds: int = 2, **timing):
    """Gram, one NS step and the full 5-step NS for the stack x [batch, m, k], XLA vs Pallas; one dict per round
    (the same compiled functions timed again, to show the spread)."""
    full_grid = dataclasses.replace(tiling, upper_only=False)
    fns = {
        "gram_xla": jax.jit(gram_reference),
        "gram_pallas": jax.jit(lambda x: symmetric_gram(x, tiling=tiling)),
        "gram_pallas_all_tiles": jax.jit(lambda x: symmetric_gram(x, tiling=full_grid)),
        "step_xla": jax.jit(newton_schulz_step),
        "step_xla_unfolded": jax.jit(newton_schulz_step_unfolded),
        "step_pallas": jax.jit(lambda x: newton_schulz_step(x, gram_impl="pallas", tiling=tiling)),
        "step_pallas_unfused": jax.jit(lambda x: ns_step_unfused(x, tiling)),
        "ns5_xla": jax.jit(lambda x: newton_schulz(x)),
        "ns5_pallas": jax.jit(lambda x: newton_schulz(x, gram_impl="pallas", tiling=tiling)),
    }
    try:
        errors = dict(gram_rel_err=rel_err(fns["gram_pallas"](x), gram_reference(x.astype(jnp.float32))),
                      ns5_rel_err_vs_xla=rel_err(fns["ns5_pallas"](x), fns["ns5_xla"](x)))
    except Exception as e:  # noqa: BLE001
        errors = dict(gram_rel_err=float("nan"), ns5_rel_err_vs_xla=float("nan"),
                      check_error=f"{type(e).__name__}: {str(e)[:300]}")
    results = []
    for r in range(rounds):
        out = dict(batch=x.shape[0], iterated=list(x.shape[1:]), round=r, **errors)
        for name, fn in fns.items():
            seconds, error = _attempt(fn, x, **timing)
            out[f"{name}_us"] = seconds * 1e6
            if error:
                out[f"{name}_error"] = error
        out["gram_xla_tflops"] = gram_flops(x) / out["gram_xla_us"] / 1e6
        out["gram_pallas_eff_tflops"] = gram_flops(x) / out["gram_pallas_us"] / 1e6
        out["gram_all_tiles_tflops"] = gram_flops(x) / out["gram_pallas_all_tiles_us"] / 1e6
        out["step_xla_tflops"] = ns_step_flops(x) / out["step_xla_us"] / 1e6
        out["step_pallas_eff_tflops"] = ns_step_flops(x) / out["step_pallas_us"] / 1e6
        for what in ("gram", "step", "ns5"):
            out[f"{what}_speedup"] = out[f"{what}_xla_us"] / out[f"{what}_pallas_us"]
        out["step_speedup_vs_unfolded"] = out["step_xla_unfolded_us"] / out["step_pallas_us"]
        out["step_xla_fold_gain"] = out["step_xla_unfolded_us"] / out["step_xla_us"]
        results.append(out)
    return results


__all__ = [
    "TILINGS",
    "bench_shape",
    "best_tiling",
    "default_tiling",
    "gemm_ceiling_tflops",
    "stacked_input",
    "sweep_step",
    "sweep_tilings",
]

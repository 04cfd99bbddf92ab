"""Measurements behind `python -m launch.bench_muon`: the symmetric Gram kernel and the Newton-Schulz step,
Pallas next to XLA, against the measured bf16 GEMM ceiling.

Timing is pallas_kernels/_bench.time_call: jit, warm up, then the median over repeats of (back-to-back calls,
block_until_ready) / calls. Each call works on a stack of `batch` matrices (Muon orthogonalises stacks: 16 experts
per layer, 40 layers), so one call lasts far longer than a dispatch. Inputs are fresh random bf16 arrays.

FLOPs are counted as XLA does the work: X Xᵀ for X [m, k] is 2·m²·k, A·A is 2·m³, B·X is 2·m²·k; one NS step
is their sum. The kernel does about (T+1)/(2T) of the first two (T = tiles per side), so its "effective" TFLOP/s
(full count / time) can exceed what it actually executes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._bench import gemm_ceiling_tflops, time_call
from pallas_kernels.symmetric_matmul import GramTiling, default_tiling, symmetric_gram
from zaya_jax.ops.newton_schulz import QUINTIC_COEFFS, gram_reference, newton_schulz, newton_schulz_step

BF16 = jnp.bfloat16

TILINGS = [GramTiling(128, 64, 8, 3), GramTiling(128, 64, 4, 3), GramTiling(128, 32, 4, 4),
           GramTiling(64, 64, 4, 3), GramTiling(128, 128, 8, 2)]


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
    """The NS step with the kernel for both products but b·A + c·A·A left to XLA (to measure the epilogue)."""
    a, b, c = QUINTIC_COEFFS
    f32 = jnp.float32
    A = symmetric_gram(x, tiling=tiling)
    B = (b * A.astype(f32) + c * symmetric_gram(A, tiling=tiling).astype(f32)).astype(x.dtype)
    return (a * x.astype(f32) + jnp.einsum("...ij,...jn->...in", B, x, preferred_element_type=f32)).astype(x.dtype)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sweep_tilings(x, tilings=TILINGS):
    """Times the Gram kernel per tiling on x; returns rows sorted fastest first (failures reported, not raised)."""
    ref = gram_reference(x.astype(jnp.float32))
    rows = []
    for tiling in tilings:
        fn = jax.jit(lambda x, t=tiling: symmetric_gram(x, tiling=t))
        try:
            err = rel_err(fn(x), ref)
            seconds = time_call(fn, x)
        except Exception as e:  # a tiling that does not compile (shared memory, registers) is skipped
            rows.append(dict(tiling=dataclasses.asdict(tiling), error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        rows.append(dict(tiling=dataclasses.asdict(tiling), us=seconds * 1e6, rel_err=err,
                         eff_tflops=gram_flops(x) / seconds / 1e12))
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


def bench_shape(rows: int, cols: int, batch: int, tiling: GramTiling, rounds: int = 2):
    """Gram, one NS step and the full 5-step NS for a stack of [rows, cols] matrices, XLA vs Pallas; one dict per
    round (the same compiled functions timed again, to show the spread)."""
    x = stacked_input(batch, rows, cols)
    full_grid = dataclasses.replace(tiling, upper_only=False)
    fns = {
        "gram_xla": jax.jit(gram_reference),
        "gram_pallas": jax.jit(lambda x: symmetric_gram(x, tiling=tiling)),
        "gram_pallas_all_tiles": jax.jit(lambda x: symmetric_gram(x, tiling=full_grid)),
        "step_xla": jax.jit(lambda x: newton_schulz_step(x)),
        "step_pallas": jax.jit(lambda x: newton_schulz_step(x, gram_impl="pallas", tiling=tiling)),
        "step_pallas_unfused": jax.jit(lambda x: ns_step_unfused(x, tiling)),
        "ns5_xla": jax.jit(lambda x: newton_schulz(x)),
        "ns5_pallas": jax.jit(lambda x: newton_schulz(x, gram_impl="pallas", tiling=tiling)),
    }
    try:
        errors = dict(gram_rel_err=rel_err(fns["gram_pallas"](x), gram_reference(x.astype(jnp.float32))),
                      ns5_rel_err_vs_xla=rel_err(fns["ns5_pallas"](x), fns["ns5_xla"](x)))
    except Exception as e:
        errors = dict(gram_rel_err=float("nan"), ns5_rel_err_vs_xla=float("nan"),
                      check_error=f"{type(e).__name__}: {str(e)[:300]}")
    results = []
    for r in range(rounds):
        out = dict(shape=[rows, cols], batch=batch, iterated=list(x.shape[1:]), round=r, **errors)
        for name, fn in fns.items():
            try:
                out[f"{name}_us"] = time_call(fn, x) * 1e6
            except Exception as e:  # report and go on: one failing variant must not hide the others
                out[f"{name}_us"] = float("nan")
                out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["gram_xla_tflops"] = gram_flops(x) / out["gram_xla_us"] / 1e6
        out["gram_pallas_eff_tflops"] = gram_flops(x) / out["gram_pallas_us"] / 1e6
        out["gram_all_tiles_tflops"] = gram_flops(x) / out["gram_pallas_all_tiles_us"] / 1e6
        out["step_xla_tflops"] = ns_step_flops(x) / out["step_xla_us"] / 1e6
        out["step_pallas_eff_tflops"] = ns_step_flops(x) / out["step_pallas_us"] / 1e6
        for what in ("gram", "step", "ns5"):
            out[f"{what}_speedup"] = out[f"{what}_xla_us"] / out[f"{what}_pallas_us"]
        results.append(out)
    return results


__all__ = ["TILINGS", "default_tiling", "gemm_ceiling_tflops", "sweep_tilings", "bench_shape", "stacked_input"]

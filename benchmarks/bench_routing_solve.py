"""Time of one balancing solve (routing_stats.balancing_correction) on [8192, 16] router scores, the bench preset's
microbatch, with the library's constants: the jnp reference ('xla') next to the one-launch Pallas kernel, and the
kernel alone at a few warp counts, on the same inputs, each result checked against the reference's. Per step = 16
microbatches x 8 layers. The bf16 GEMM ceiling is printed for scale.

python -m benchmarks.bench_routing_solve [--out FILE.json]"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.bench import gemm_ceiling_tflops, time_call
from zaya_jax.model import routing_stats as rs
from pallas_kernels import balancing_solve as kernel
from zaya_jax.ops import balancing_solve

N, E, CALLS_PER_STEP = 8192, 16, 16 * 8


def main():
    scores = 1 / 17 + jax.random.normal(jax.random.key(0), (N, E)) * 1e-4
    valid = jnp.ones(N, bool)
    block, block_valid = scores[:rs.SOLVE_TOKENS].T, valid[:rs.SOLVE_TOKENS]
    constants = dict(rounds=rs.SOLVE_ROUNDS, damping=rs.SOLVE_DAMPING, momentum=rs.SOLVE_MOMENTUM)
    # the whole correction (subset gather, solve, mask) per impl, then the kernel alone per warp count
    variants = [(f"correction {impl}", None, jax.jit(lambda s, impl=impl: rs.balancing_correction(s, valid, impl)),
                 scores) for impl in ("xla", "pallas")]
    variants.append(("solve xla", None, jax.jit(lambda b: balancing_solve.solve(b, block_valid, **constants)), block))
    variants += [("solve pallas", w, jax.jit(lambda b, w=w: kernel.solve(b, block_valid, num_warps=w, **constants)),
                  block) for w in (4, 8, 16)]
    expected = {"correction": np.asarray(variants[0][2](scores)), "solve": np.asarray(variants[2][2](block))}
    rows = []
    for name, warps, fn, x in variants:
        us = time_call(fn, x) * 1e6
        rows.append(dict(what=name, num_warps=warps, us_per_call=round(us, 1),
                         ms_per_step=round(us * CALLS_PER_STEP / 1e3, 2),
                         max_abs_diff_to_xla=float(np.abs(np.asarray(fn(x)) - expected[name.split()[0]]).max())))
        print(rows[-1], flush=True)
    result = dict(device=jax.devices()[0].device_kind, scores=[N, E], tokens_read=rs.SOLVE_TOKENS, **constants,
                  gemm_bf16_tflops=gemm_ceiling_tflops(), rows=rows,
                  correction_speedup=round(rows[0]["us_per_call"] / rows[1]["us_per_call"], 2))
    print(json.dumps(result), flush=True)
    if "--out" in sys.argv:
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

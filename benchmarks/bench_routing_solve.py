"""Time of one balancing solve (routing_stats.balancing_correction) on [8192, 16] router scores, the bench preset's
microbatch, with the library's constants: the sorting rounds ('xla') next to the counting ones ('pallas',
ops/order_statistics.py) on the same inputs, each result checked against the first. Per step = 16 microbatches x 8
layers. The bf16 GEMM ceiling is printed for scale.

python -m benchmarks.bench_routing_solve [--out FILE.json]"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.bench import gemm_ceiling_tflops, time_call
from zaya_jax.model import routing_stats as rs

N, E, CALLS_PER_STEP = 8192, 16, 16 * 8


def main():
    scores = 1 / 17 + jax.random.normal(jax.random.key(0), (N, E)) * 1e-4
    valid = jnp.ones(N, bool)
    rows, expected = [], None
    for impl in ("xla", "pallas"):
        fn = jax.jit(lambda s, impl=impl: rs.balancing_correction(s, valid, impl))
        out = np.asarray(fn(scores))
        expected = out if expected is None else expected
        us = time_call(fn, scores) * 1e6
        rows.append(dict(impl=impl, us_per_solve=round(us, 1), ms_per_step=round(us * CALLS_PER_STEP / 1e3, 2),
                         max_abs_diff_to_xla=float(np.abs(out - expected).max())))
        print(rows[-1], flush=True)
    result = dict(device=jax.devices()[0].device_kind, scores=[N, E], tokens_read=rs.SOLVE_TOKENS,
                  rounds=rs.SOLVE_ROUNDS, gemm_bf16_tflops=gemm_ceiling_tflops(), rows=rows,
                  pallas_speedup=round(rows[0]["us_per_solve"] / rows[1]["us_per_solve"], 2))
    print(json.dumps(result), flush=True)
    if "--out" in sys.argv:
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Time of one balancing solve (routing_stats.balancing_correction) on [8192, 16] scores, the bench preset's
microbatch, at the library's constants: the XLA rounds (a sort each) against the Pallas rounds (one launch each,
pallas_kernels/balancing_solve.py) at its defaults and at other token chunks and warp counts; same
inputs, one process; per step = 16 microbatches x 8 layers. Medians of 7 repeats of 50 calls.

python benchmarks/bench_routing_solve.py [--out FILE.json]"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import balancing_solve as kernel
from zaya_jax.model import routing_stats as rs

N, E, CALLS_PER_STEP = 8192, 16, 16 * 8


def time_solve(impl, chunk=None, warps=None):
    kernel.CHUNK = chunk or default_chunk
    default_warps = kernel._warps
    if warps:
        kernel._warps = lambda n: warps
    x = jax.random.uniform(jax.random.key(0), (N, E)) * 1e-3
    f = jax.jit(lambda s: rs.balancing_correction(s, jnp.ones(N, bool), impl))
    delta = f(x)
    kernel._warps = default_warps
    kernel.CHUNK = default_chunk
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(50):
            r = f(x)
        r.block_until_ready()
        ts.append((time.perf_counter() - t) / 50)
    return float(np.median(ts) * 1e6), np.asarray(delta)


default_chunk = kernel.CHUNK
rows, reference = [], None
variants = [("pallas", None, None)] + [("pallas", chunk, warps) for chunk in (512, 2048) for warps in (4, 8, 16)]
for impl, chunk, warps in [("xla", None, None)] + variants + [("xla", None, None)]:
    try:
        us, delta = time_solve(impl, chunk, warps)
    except Exception as err:  # a variant Triton cannot compile (registers) is reported, not fatal
        rows.append(dict(impl=impl, chunk=chunk, warps=warps, error=str(err)[:300]))
        print(rows[-1], flush=True)
        continue
    reference = delta if reference is None else reference
    rows.append(dict(impl=impl, chunk=chunk, warps=warps, rounds=rs.SOLVE_ROUNDS, tokens=rs.SOLVE_TOKENS,
                     us_per_solve=round(us, 1), ms_per_step=round(us * CALLS_PER_STEP / 1e3, 2),
                     max_abs_diff_vs_xla=float(np.abs(delta - reference).max())))
    print(rows[-1], flush=True)
xla = np.median([r["us_per_solve"] for r in rows if r["impl"] == "xla"])
for r in rows:
    if "us_per_solve" in r:
        r["xla_over_this"] = round(xla / r["us_per_solve"], 3)
if "--out" in sys.argv:
    json.dump(dict(device=jax.devices()[0].device_kind, shape=[N, E], rows=rows),
              open(sys.argv[sys.argv.index("--out") + 1], "w"), indent=1)

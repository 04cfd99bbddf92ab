"""Time of one balancing solve (routing_stats.balancing_correction) on [8192, 16] scores, the bench preset's
microbatch, at the library's constants and for a few other round counts and token subsets, with the rounds in a
lax.scan and unrolled; per step = 16 microbatches x 8 layers.

python benchmarks/bench_routing_solve.py [--out FILE.json]"""

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.model import routing_stats as rs

N, E, CALLS_PER_STEP = 8192, 16, 16 * 8
scan = jax.lax.scan


def time_solve(rounds, tokens, unroll):
    rs.SOLVE_ROUNDS, rs.SOLVE_TOKENS = rounds, tokens
    jax.lax.scan = functools.partial(scan, unroll=True) if unroll else scan
    x = jax.random.uniform(jax.random.key(0), (N, E)) * 1e-3
    f = jax.jit(lambda s: rs.balancing_correction(s, jnp.ones(N, bool)))
    f(x).block_until_ready()
    jax.lax.scan = scan
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(50):
            r = f(x)
        r.block_until_ready()
        ts.append((time.perf_counter() - t) / 50)
    return float(np.median(ts) * 1e6)


rows = []
for rounds, tokens, unroll in ((rs.SOLVE_ROUNDS, 2048, False), (16, 2048, False),
                               (16, 2048, True), (8, 2048, True), (16, 8192, False),
                               (16, 8192, True)):
    us = time_solve(rounds, tokens, unroll)
    rows.append(dict(rounds=rounds, tokens=tokens, unrolled=unroll, us_per_solve=round(us, 1),
                     ms_per_step=round(us * CALLS_PER_STEP / 1e3, 2)))
    print(rows[-1], flush=True)
if "--out" in sys.argv:
    json.dump(dict(device=jax.devices()[0].device_kind, shape=[N, E], rows=rows),
              open(sys.argv[sys.argv.index("--out") + 1], "w"), indent=1)

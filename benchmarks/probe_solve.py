"""Where a Pallas balancing solve's time goes ([16, 2048] router scores, the library's rounds): its wall time per
solve against versions of the round kernel with parts taken out (no order-statistic search; an empty round that
only carries the state), the median launch alone, and the kernels' summed device time and span in a profiler trace
of the full solve. Medians of 7 repeats of 50 calls.

python -m benchmarks.probe_solve [--out FILE.json]"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.systems import profile_trace
from benchmarks.systems.timing import seconds_per_call
from pallas_kernels import balancing_solve as kernel
from zaya_jax.model import routing_stats as rs

E, N = 16, rs.SOLVE_TOKENS


def no_search(chunks, k, guess=None):  # one reduction for the search: the loads, margins and launch remain
    top = functools.reduce(jnp.maximum, [jnp.max(c) for c in chunks])
    return top, top


def empty_round(scores_ref, valid_ref, delta_ref, change_ref, middle_ref, kth_ref, delta_out, change_out, middle_out,
                kth_out, *, num_experts, num_tokens, damping, momentum):  # the state carried, nothing read
    delta, change = kernel.next_change(delta_ref[...], change_ref[...], middle_ref[...], num_experts, damping,
                                       momentum)
    delta_out[...] = delta
    change_out[...] = change
    middle_out[...] = jnp.zeros((1,), jnp.float32)
    kth_out[...] = jnp.zeros((1,), jnp.float32)


def timed(rounds=rs.SOLVE_ROUNDS, **patch):
    saved = {name: getattr(kernel, name) for name in patch}
    for name, value in patch.items():
        setattr(kernel, name, value)
    try:
        scores = 1 / 17 + jax.random.normal(jax.random.key(0), (E, N)) * 1e-4
        f = jax.jit(lambda s: kernel.solve(s, jnp.ones(N, bool), rounds=rounds, damping=rs.SOLVE_DAMPING,
                                           momentum=rs.SOLVE_MOMENTUM))
        f(scores).block_until_ready()
    finally:
        for name, value in saved.items():
            setattr(kernel, name, value)
    return f, scores, seconds_per_call(f, scores, reps=7, calls=50, warmup=0) * 1e6


def trace(f, scores):
    ops = profile_trace.device_ops_of_calls(f, scores, calls=5)
    return dict(kernels_per_solve=len(ops) / 5, kernel_us_per_solve=sum(e.duration_ns for e in ops) / 5e3,
                kernel_us_median=float(np.median([e.duration_ns for e in ops]) / 1e3),
                gap_us_median=float(np.median([b.start_ns - a.start_ns - a.duration_ns for a, b in zip(ops, ops[1:])])
                                    / 1e3))


rows = {}
for name, kwargs in [("full", {}), ("no_search", dict(_kth_and_next=no_search)),
                     ("empty_rounds", dict(_round_kernel=empty_round)), ("median_only", dict(rounds=0)),
                     ("full_again", {})]:
    f, scores, us = timed(**kwargs)
    rows[name] = dict(us_per_solve=round(us, 1), **(trace(f, scores) if name == "full" else {}))
    print(name, rows[name], flush=True)
if "--out" in sys.argv:
    json.dump(dict(device=jax.devices()[0].device_kind, shape=[E, N], rounds=rs.SOLVE_ROUNDS, rows=rows),
              open(sys.argv[sys.argv.index("--out") + 1], "w"), indent=1)

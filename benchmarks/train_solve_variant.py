"""launch.train with the balancing solve's constants (zaya_jax/model/routing_stats.py) set from the environment,
for the comparisons of docs/routing.md:

    SOLVE_ROUNDS=16 SOLVE_TOKENS=8192 SOLVE_DAMPING=0.8 SOLVE_START=zero python -m benchmarks.train_solve_variant \
        --config benchmarks/routing_bench_config.py --config.train.steps=24 --workdir DIR

ROUTING=round_robin|collapsed|random (with --config.balancing.learning_rate=0.0, so that nothing solves) replaces the
router's choice of expert by a baseline of benchmarks/routing_baselines.py.
EQUAL_SHARES=off leaves the train step's selection at the argmax with the solve's correction (model/equal_shares.py
not applied): what equal shares cost a step, measured inside it.

BLOCK_ROWS sets the grouped GEMM's row unit (each expert's token group is padded to a multiple of it) for the run.
"""

import contextlib
import os
import runpy
import sys

import jax.numpy as jnp

from benchmarks.routing_baselines import ROUTINGS, replace_routing
from zaya_jax.model import router, routing_stats

for name, kind in (("SOLVE_ROUNDS", int), ("SOLVE_TOKENS", int), ("SOLVE_DAMPING", float), ("SOLVE_MOMENTUM", float),
                   ("SOLVE_START", str)):
    if name in os.environ:
        setattr(routing_stats, name, kind(os.environ[name]))
print(f"solve: rounds {routing_stats.SOLVE_ROUNDS}, tokens {routing_stats.SOLVE_TOKENS}, damping "
      f"{routing_stats.SOLVE_DAMPING}, momentum {routing_stats.SOLVE_MOMENTUM}, start {routing_stats.SOLVE_START}",
      flush=True)

routing = os.environ.get("ROUTING")
if routing is not None and routing not in ROUTINGS:
    sys.exit(f"train_solve_variant: ROUTING={routing!r} unknown; use one of {ROUTINGS}")
if routing is not None:
    replace_routing(routing)
    print(f"routing: {routing} (the router's choice replaced)", flush=True)
if os.environ.get("EQUAL_SHARES", "on") not in ("on", "off"):
    sys.exit(f"train_solve_variant: EQUAL_SHARES={os.environ['EQUAL_SHARES']!r} unknown; use on or off")
if os.environ.get("EQUAL_SHARES") == "off":
    router.equal_shares = lambda scores, index, valid: (index, jnp.zeros(index.shape, bool))
    print("equal shares: off (selection by the argmax with the solve's correction)", flush=True)
sys.argv[0] = "launch.train"
with contextlib.ExitStack() as stack:
    if "BLOCK_ROWS" in os.environ:
        from pallas_kernels.grouped_matmul import tiling_override
        stack.enter_context(tiling_override(block_rows=int(os.environ["BLOCK_ROWS"])))
        print(f"grouped GEMM row unit: {os.environ['BLOCK_ROWS']}", flush=True)
    runpy.run_module("launch.train", run_name="__main__")

"""launch.train with the balancing solve's constants (zaya_jax/model/routing_stats.py) set from the environment,
for the comparisons of docs/routing.md:

    SOLVE_ROUNDS=16 SOLVE_TOKENS=8192 SOLVE_DAMPING=0.8 python -m benchmarks.train_solve_variant \
        --config benchmarks/routing_bench_config.py --config.train.steps=24 --workdir DIR
"""

import os
import runpy
import sys

from zaya_jax.model import routing_stats

for name, kind in (("SOLVE_ROUNDS", int), ("SOLVE_TOKENS", int), ("SOLVE_DAMPING", float), ("SOLVE_MOMENTUM", float)):
    if name in os.environ:
        setattr(routing_stats, name, kind(os.environ[name]))
print(f"solve: rounds {routing_stats.SOLVE_ROUNDS}, tokens {routing_stats.SOLVE_TOKENS}, "
      f"damping {routing_stats.SOLVE_DAMPING}, momentum {routing_stats.SOLVE_MOMENTUM}", flush=True)
sys.argv[0] = "launch.train"
runpy.run_module("launch.train", run_name="__main__")

"""launch.train with the balancing solve's constants (zaya_jax/model/routing_stats.py) set from the environment,
for the comparisons of docs/routing.md:

    SOLVE_ROUNDS=16 SOLVE_TOKENS=8192 SOLVE_DAMPING=0.8 python -m benchmarks.train_solve_variant \
        --config benchmarks/routing_bench_config.py --config.train.steps=24 --workdir DIR

ROUND_ROBIN=1 (with --config.balancing.learning_rate=0.0, so that nothing solves) routes token i of each forward to
expert i mod E instead: every expert gets an equal share at no balancing cost, the baseline that separates what
the controller costs a step from what routing to every expert costs (tile padding, one weight read per expert).
"""

import os
import runpy
import sys

import jax.numpy as jnp

from zaya_jax.model import router, routing_stats

for name, kind in (("SOLVE_ROUNDS", int), ("SOLVE_TOKENS", int), ("SOLVE_DAMPING", float), ("SOLVE_MOMENTUM", float)):
    if name in os.environ:
        setattr(routing_stats, name, kind(os.environ[name]))
print(f"solve: rounds {routing_stats.SOLVE_ROUNDS}, tokens {routing_stats.SOLVE_TOKENS}, "
      f"damping {routing_stats.SOLVE_DAMPING}, momentum {routing_stats.SOLVE_MOMENTUM}", flush=True)

if os.environ.get("ROUND_ROBIN") == "1":
    routed = router.Router.__call__

    def round_robin(self, x, prev_state, state_scale, token_mask=None):
        weight, index, u, probs, correction = routed(self, x, prev_state, state_scale, token_mask)
        index = (jnp.arange(index.size, dtype=index.dtype) % self.cfg.num_experts).reshape(index.shape)
        weight = jnp.take_along_axis(probs, index[..., None], axis=-1)[..., 0]
        return weight, index, u, probs, correction

    router.Router.__call__ = round_robin
    print("routing: token i to expert i mod E (round robin)", flush=True)
sys.argv[0] = "launch.train"
runpy.run_module("launch.train", run_name="__main__")

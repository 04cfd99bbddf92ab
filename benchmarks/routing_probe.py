"""Dumps the routers' selection scores (probabilities + stored biases, [N, E]) of chosen training steps, to find
out offline why a layer's balance is off: python -m benchmarks.routing_probe OUT_DIR --steps 2,12,18,19 [--layers 4,5] -- \
    --config benchmarks/routing_bench_config.py --workdir DIR [--config.x=...]

Runs launch.train with routing_stats.balancing_correction wrapped by a host callback. Calls are numbered in
execution order; with the layers scanned and the correction kept by remat, one optimizer step makes
microbatches x layers calls. OUT_DIR/step_SSS.npz holds the step's first microbatch: scores [L, N, E], valid [L, N]
and the in-graph correction [L, E]; OUT_DIR/step_SSS_layer_L.npz every microbatch [M, ...] of the layers named; OUT_DIR/memory.json the device's memory statistics at exit."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys

import jax
import numpy as np

from zaya_jax.model import routing_stats


def main():
    out, steps_arg, rest = sys.argv[1], sys.argv[3], sys.argv[sys.argv.index("--") + 1:]
    steps = {int(s) for s in steps_arg.split(",")}
    every_microbatch = {int(s) for s in sys.argv[5].split(",")} if sys.argv[4] == "--layers" else set()
    os.makedirs(out, exist_ok=True)
    calls, dumps = [0], {}
    per_step = layers = None
    original = routing_stats.balancing_correction

    def dump(scores, valid, correction):
        c = calls[0]
        calls[0] += 1
        step, layer = c // per_step + 1, c % layers
        if per_step and step in steps and (c % per_step < layers or layer in every_microbatch):
            key = (step, layer) if layer in every_microbatch else (step, None)
            dumps.setdefault(key, []).append((np.asarray(scores), np.asarray(valid), np.asarray(correction)))

    def write():
        for (step, layer), rows in dumps.items():
            name = f"step_{step:03d}" + ("" if layer is None else f"_layer_{layer}")
            np.savez(os.path.join(out, name + ".npz"), **{
                name: np.stack([r[i] for r in rows]) for i, name in enumerate(("scores", "valid", "correction"))})
        with open(os.path.join(out, "memory.json"), "w") as f:
            json.dump(jax.devices()[0].memory_stats(), f, indent=1)

    def wrapped(scores, valid, impl="xla"):
        correction = original(scores, valid, impl)
        jax.debug.callback(dump, scores, valid, correction)
        return correction

    routing_stats.balancing_correction = wrapped
    atexit.register(write)
    from zaya_jax.train.cli_config import split_open_flags  # noqa: F401  (launch.train's own parsing follows)
    config_path = rest[rest.index("--config") + 1]
    config = runpy.run_path(config_path)["get_config"]()
    microbatches = config.train.global_batch_tokens // config.train.microbatch_tokens
    from zaya_jax.config import preset
    layers = preset(config.model.preset).num_hidden_layers
    per_step = microbatches * layers
    sys.argv = ["launch.train", *rest]
    runpy.run_module("launch.train", run_name="__main__")


if __name__ == "__main__":
    main()

"""Routing health of the first training steps under several balancing-controller settings: the trainer
(zaya_jax.train.loop.run) on a config file, logging every step, and per step the worst layer's expert loads.

python -m benchmarks.routing_sweep --config configs/default.py --steps 60 \
    --out benchmarks/results/routing_tiny_sweep.json --variant off:learning_rate=0 --variant adam:rule=adam,learning_rate=5e-3 ...
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile


def parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition(":")
    return name, {key: parse_value(value) for key, _, value in
                  (item.partition("=") for item in filter(None, spec.split(",")))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.py")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--variant", action="append", required=True, help="NAME:key=value,... of config.balancing")
    ap.add_argument("--set", action="append", default=[], help="config key=value (dotted), e.g. train.eval_every=0")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from zaya_jax.train.loop import run

    results = {"command": " ".join([sys.executable, "-m", "benchmarks.routing_sweep"] + (argv or sys.argv[1:])),
               "variants": {}}
    for text in args.variant:
        name, values = parse_variant(text)
        config = runpy.run_path(args.config)["get_config"]()
        config.train.steps = config.optim.total_steps = args.steps
        config.train.log_every = 1
        config.train.eval_every = args.steps
        config.train.checkpoint_every = 10 * args.steps
        for item in args.set:
            key, _, value = item.partition("=")
            node = config
            *parents, leaf = key.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = parse_value(value)
        for key, value in values.items():
            config.balancing[key] = value
        with tempfile.TemporaryDirectory() as workdir:
            last = run(config, workdir, log=lambda *_: None)
            rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
        steps = [r for r in rows if "loss" in r]
        results["variants"][name] = {
            "balancing": values,
            "eval_loss": last.get("eval_loss"),
            "per_step": [{k: r[k] for k in ("step", "loss", "max_load", "min_load", "dead_experts", "grad_norm")}
                         | {"spread": max(v for k, v in r.items() if k.startswith("routing/spread/"))}
                         for r in steps],
            "last_row": steps[-1],
        }
        summary = results["variants"][name]["per_step"]
        print(name, values, "eval_loss", last.get("eval_loss"))
        for r in summary:
            if r["step"] in (1, 2, 3, 5, 10, 15, 20, 30, 40, 60, 100, 150, 200) or r["step"] == args.steps:
                print(f"  step {r['step']:4d} loss {r['loss']:.3f} max_load {r['max_load']:.2f} "
                      f"min_load {r['min_load']:.2f} dead {r['dead_experts']:.0f} spread {r['spread']:.2e}")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

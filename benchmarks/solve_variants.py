"""Offline comparison of balancing-solve constants (zaya_jax/model/routing_stats.py: rounds, damping, momentum) on
router scores dumped from real training (benchmarks/routing_probe.py) and on random scores with tight clusters
(the case of tests/test_balancing.py): the busiest expert's share after each variant's solve, relative to uniform.

    python -m benchmarks.routing_probe DUMPS --steps 3,10,20,30,40 --layers 1,3 -- --config CFG --workdir DIR
    python -m benchmarks.solve_variants DUMPS [--draws 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.model import routing_stats

VARIANTS = {"32 rounds": (32, 0.0), "16 rounds": (16, 0.0), "16 rounds, momentum 0.3": (16, 0.3),
            "16 rounds, momentum 0.4": (16, 0.4), "20 rounds, momentum 0.3": (20, 0.3),
            "20 rounds, momentum 0.4": (20, 0.4), "16 rounds, momentum 0.5": (16, 0.5),
            "24 rounds, momentum 0.3": (24, 0.3), "24 rounds, momentum 0.4": (24, 0.4)}


def clustered(rng, n=2048, e=16, spread=1e-3):
    """60% of the tokens in six tight clusters (tests/test_balancing.py's generator)."""
    centers = rng.normal(size=(6, e)) * 3 * spread
    cluster = rng.integers(0, 10, n)
    scores = rng.normal(size=(n, e)) * spread + rng.normal(size=e) * 5 * spread
    tight = cluster < 6
    scores[tight] = centers[cluster[tight]] + rng.normal(size=(tight.sum(), e)) * 0.05 * spread
    return scores.astype(np.float32)


def max_load(scores, delta):
    e = scores.shape[1]
    counts = np.bincount(np.argmax(scores + np.asarray(delta), -1), minlength=e)
    return float(counts.max() / (len(scores) / e))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", help="a routing_probe output directory (its step_*_layer_*.npz: every microbatch)")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="variant names separated by semicolons")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dumped = [s for f in sorted(glob.glob(os.path.join(args.dumps, "step_*_layer_*.npz")))
              for s in np.load(f)["scores"]]
    rng = np.random.default_rng(args.seed)
    synthetic = [clustered(rng) for _ in range(args.draws)]
    report = dict(dumps=os.path.abspath(args.dumps), dumped_forwards=len(dumped), synthetic_draws=args.draws,
                  seed=args.seed, damping=routing_stats.SOLVE_DAMPING, variants={})
    names = args.only.split(";") if args.only else list(VARIANTS)
    for name in names:
        rounds, momentum = VARIANTS[name]
        routing_stats.SOLVE_ROUNDS, routing_stats.SOLVE_MOMENTUM = rounds, momentum
        solve = jax.jit(lambda s, v: routing_stats.balancing_correction(s, v))  # a new trace per variant
        row = {}
        for label, group in (("dumped", dumped), ("clustered", synthetic)):
            loads = np.array([max_load(s, solve(jnp.asarray(s), jnp.ones(len(s), bool))) for s in group])
            row[label] = dict(p50=round(float(np.median(loads)), 3), p90=round(float(np.percentile(loads, 90)), 3),
                              max=round(float(loads.max()), 3), over_1_5=round(float((loads > 1.5).mean()), 4))
        report["variants"][name] = row
        print(f"{name:26s} {row}", flush=True)
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

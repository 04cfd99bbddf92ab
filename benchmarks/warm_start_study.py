"""Offline: how far from balance a step's microbatches would be, and how many tokens equal shares would move, if the
balancing solve started from the stored biases (which hold the step's earlier microbatches' solves) and ran a few
rounds, instead of the full solve from the median start in every microbatch. On benchmarks.routing_probe dumps of
every microbatch of chosen layers (step_SSS_layer_L.npz: scores [M, N, E], the probabilities plus the stored biases
when that microbatch ran):

    python -m benchmarks.routing_probe DUMPS --steps 5,20,60,120,190 --layers 0,1,2,3 -- --config CFG --workdir DIR
    python -m benchmarks.warm_start_study DUMPS [--out FILE.json]

Variants: the library's solve; 0-8 rounds from the stored biases; 2-8 rounds from the median start (on all of a
microbatch's tokens). Per variant, separately for each step's first microbatch (the optimizer has just moved the
router) and the later ones: the busiest expert's share relative to uniform after the solve, and the share of the
tokens equal shares move.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.model import routing_stats as rs
from zaya_jax.model.equal_shares import equal_shares
from zaya_jax.ops.balancing_solve import solve_reference

WARM_ROUNDS = (0, 2, 4, 8)


def rounds_from(scores, valid, rounds: int, start: str):
    """`rounds` of the solve from no change (the stored biases as they are: 'stored') or from the experts' median
    scores equalised ('median', the library's start)."""
    if rounds == 0:
        return jnp.zeros(scores.shape[1])
    return solve_reference(scores.T, valid, rounds=rounds, damping=rs.SOLVE_DAMPING, momentum=rs.SOLVE_MOMENTUM,
                           start="zero" if start == "stored" else "median")


@jax.jit
def outcome(scores, valid, delta):
    """(max load relative to uniform, share of the valid tokens equal shares move) of a selection with delta."""
    index = jnp.argmax(scores + delta, -1).astype(jnp.int32)
    experts = scores.shape[1]
    counts = jnp.zeros(experts).at[index].add(valid)
    _, moved = equal_shares(scores + delta, index, valid)
    return counts.max() / valid.sum() * experts, (moved & valid).sum() / valid.sum()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks.warm_start_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", help="a folder of benchmarks.routing_probe dumps (step_SSS_layer_L.npz)")
    ap.add_argument("--out", default=None, help="write the summary and every forward's figures here (JSON)")
    args = ap.parse_args(argv)
    variants = {"full solve (24 rounds, median start)": lambda s, v: rs.balancing_correction(s, v, "xla")}
    for start in ("stored", "median"):
        variants.update({f"{start} start + {r} rounds": (lambda r, a: jax.jit(lambda s, v: rounds_from(s, v, r, a)))(
            r, start) for r in WARM_ROUNDS if r or start == "stored"})
    rows = {name: {"first": [], "later": []} for name in variants}
    files = sorted(glob.glob(os.path.join(args.dumps, "step_*_layer_*.npz")))
    if not files:
        sys.exit(f"warm_start_study: no step_SSS_layer_L.npz dumps in {args.dumps}")
    for path in files:
        step, layer = map(int, re.findall(r"\d+", os.path.basename(path)))
        dump = np.load(path)
        for m, (scores, valid) in enumerate(zip(dump["scores"], dump["valid"])):
            scores, valid = jnp.asarray(scores, jnp.float32), jnp.asarray(valid, bool)
            for name, solve in variants.items():
                load, moved = outcome(scores, valid, solve(scores, valid))
                rows[name]["first" if m == 0 else "later"].append((step, layer, float(load), float(moved)))
    summary = {}
    for name, parts in rows.items():
        summary[name] = {}
        for part, values in parts.items():
            loads, moved = np.array([v[2] for v in values]), np.array([v[3] for v in values])
            summary[name][part] = {"forwards": len(values), "max_load_median": round(float(np.median(loads)), 3),
                                   "max_load_max": round(float(loads.max()), 3),
                                   "moved_median": round(float(np.median(moved)), 4),
                                   "moved_max": round(float(moved.max()), 4)}
            print(f"{name:40s} {part:6s} {summary[name][part]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dumps": args.dumps, "summary": summary, "per_forward": rows}, f, indent=1)


if __name__ == "__main__":
    main()

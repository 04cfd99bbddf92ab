"""Where a model load goes: cProfile of inference's load_model on a checkpoint, the functions with the most own time.

python -m benchmarks.profile_load DIR [--dtype bfloat16] [--top 25]"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.inference.loading import load_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    start = time.perf_counter()
    jnp.zeros(1).block_until_ready()
    print(f"backend start {time.perf_counter() - start:.1f} s")
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    model = load_model(args.checkpoint, dtype=args.dtype)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    profile.disable()
    print(f"load_model {time.perf_counter() - start:.1f} s")
    report = io.StringIO()
    pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(args.top)
    print(report.getvalue())


if __name__ == "__main__":
    main()

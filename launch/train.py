"""python -m launch.train [--preset tiny] : the main job.

Until the training loop lands (issue 4) this runs a jit-compiled forward pass of the chosen preset on random
tokens and prints parameter counts, logits statistics and the router's expert loads.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from zaya_jax.config import PRESETS, preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model_info import describe


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = preset(args.preset)
    print(describe(cfg))
    model = ZayaForCausalLM(cfg, seed=args.seed)
    ids = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.seq), 3, cfg.vocab_size)
    fwd = jax.jit(lambda ids: model.forward(ids))
    t0 = time.perf_counter()
    logits, aux = jax.block_until_ready(fwd(ids))
    t1 = time.perf_counter()
    logits, aux = jax.block_until_ready(fwd(ids))
    t2 = time.perf_counter()
    print(f"forward [{args.batch} x {args.seq}] on {jax.devices()[0].platform}: compile+run {t1 - t0:.2f}s, "
          f"run {1e3 * (t2 - t1):.1f} ms")
    print(f"logits {tuple(logits.shape)} {logits.dtype}: mean {float(jnp.mean(logits)):+.4f} "
          f"std {float(jnp.std(logits)):.4f} finite {bool(jnp.all(jnp.isfinite(logits)))}")
    load = aux.expert_counts / aux.expert_counts.sum(-1, keepdims=True)
    print("expert load per layer (fraction of tokens, last column = skip):")
    for i, row in enumerate(load):
        print(f"  layer {i:2d}: " + " ".join(f"{x:.2f}" for x in row.tolist()))


if __name__ == "__main__":
    main()

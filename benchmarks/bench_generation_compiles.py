"""Generation over prompts of many lengths, as pass@k sampling or lm-eval's generate_until run it: one `generate` call
per prompt (random lengths, a fixed seed), with the XLA compilations counted and the wall time of the whole loop.

python -m benchmarks.bench_generation_compiles [--preset tiny] [--prompts 16] [--max-prompt 300] [--new-tokens 32]
                                               [--batch 1] [--out FILE.json]"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks.bench_inference import init_model
from zaya_jax.inference import Decoder, generate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    compiles = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    model = init_model(args.preset)
    decoder = Decoder(model)
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, args.max_prompt + 1, args.prompts).tolist()
    before = len(compiles)
    start = time.perf_counter()
    for n in lengths:
        prompt = rng.integers(3, model.cfg.vocab_size, n).tolist()
        generate(decoder, [prompt] * args.batch, max_new_tokens=args.new_tokens)
    wall = time.perf_counter() - start
    report = dict(preset=args.preset, device=jax.devices()[0].device_kind, prompt_lengths=lengths,
                  new_tokens=args.new_tokens, batch=args.batch, wall_s=round(wall, 2),
                  compilations=len(compiles) - before, compile_s=round(sum(compiles[before:]), 2))
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a scoring call's time goes: one Scorer.loglikelihood call of B rows x L tokens (the loss over each row's
last C tokens, as lm-eval scores continuations) under jax.profiler, its kernels by HLO op and by model source line,
per call, against the median wall time of the call.

python -m benchmarks.profile_scoring [--preset zaya1_8b] [--batch 32] [--length 1024] [--continuation 32]
                                     [--kernels auto|xla] [--out FILE.json]"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks.bench_inference import init_model
from benchmarks.profile_decode import dump_optimized_hlo, kernel_tables
from zaya_jax.inference.scoring import Scorer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=32)
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla"])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dump = dump_optimized_hlo()
    model = init_model(args.preset)
    scorer = Scorer(model, max_length=args.length, batch_size=args.batch, buckets=(args.length,),
                    kernels=args.kernels)
    tokens = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (args.batch, args.length + 1)).tolist()
    c = args.continuation
    requests = [(t[:-c], t[-c:]) for t in tokens]

    def run():
        start = time.perf_counter()
        scorer.loglikelihood(requests)
        return time.perf_counter() - start

    run()  # compile
    walls = [run() for _ in range(3)]
    report = dict(preset=args.preset, batch=args.batch, length=args.length, continuation=c, kernels=args.kernels,
                  device=jax.devices()[0].device_kind, wall_ms_median=float(np.median(walls)) * 1e3,
                  tokens_per_s=args.batch * args.length / float(np.median(walls)),
                  **kernel_tables(run, dump, 1, "call", args.top))
    print(json.dumps(report, indent=1))
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

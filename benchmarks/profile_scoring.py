"""Where a scoring call's time goes: one Scorer.loglikelihood call of B rows x L tokens (the loss over each row's
last C tokens, as lm-eval scores continuations) under jax.profiler, its kernels by HLO op and by model source line,
per call, against the median wall time of the call.

python -m benchmarks.profile_scoring [--preset zaya1_8b] [--batch 32] [--length 1024] [--continuation 32]
                                     [--kernels auto|xla] [--out FILE.json]"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.bench_inference import init_model
from benchmarks.profile_decode import dump_optimized_hlo, parse_args, profile
from zaya_jax.inference.scoring import Scorer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=32)
    args = parse_args(ap)
    dump = dump_optimized_hlo()
    model = init_model(args.preset)
    scorer = Scorer(model, max_length=args.length, batch_size=args.batch, buckets=(args.length,),
                    kernels=args.kernels)
    tokens = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (args.batch, args.length + 1)).tolist()
    c = args.continuation
    requests = [(t[:-c], t[-c:]) for t in tokens]
    profile(args, dump, lambda: scorer.loglikelihood(requests), 1, "call", batch=args.batch, length=args.length,
            continuation=c)


if __name__ == "__main__":
    main()

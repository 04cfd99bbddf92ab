"""Where a greedy decode step's time goes: the decode loop of `generate_padded` under jax.profiler, its device
kernels grouped by HLO op (total time per generated token, count per token), against the wall time per token
(which includes the prefill).

python -m benchmarks.profile_decode [--preset zaya1_8b] [--batch 1] [--prompt 512] [--new-tokens 64]
                                    [--kernels auto|xla] [--out FILE.json]"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

import jax
import numpy as np

from benchmarks.bench_inference import init_model
from benchmarks.systems import profile_trace
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.generate import generate_padded


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla"])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = init_model(args.preset)
    decoder = Decoder(model, kernels=args.kernels)
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (args.batch, args.prompt)).astype(np.int32)

    def run():
        start = time.perf_counter()
        out = generate_padded(decoder, ids, max_new_tokens=args.new_tokens)
        return time.perf_counter() - start, out

    run()  # compile
    walls = [run()[0] for _ in range(3)]
    logdir = tempfile.mkdtemp(prefix="profile_decode_")
    with jax.profiler.trace(logdir):
        run()
    ops, _, lines = profile_trace.load(logdir)
    per_op = collections.defaultdict(lambda: [0.0, 0])
    for e in ops:
        # kernels replayed from a command buffer (CUDA graph) carry the buffer's op name: name them by kernel
        key = e.name if not e.hlo_op or e.hlo_op.startswith("command_buffer") else e.hlo_op
        per_op[key][0] += e.duration_ns
        per_op[key][1] += 1
    tokens = args.new_tokens
    busy_ms = sum(v[0] for v in per_op.values()) / 1e6
    top = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:args.top]
    report = dict(preset=args.preset, batch=args.batch, prompt=args.prompt, new_tokens=tokens, kernels=args.kernels,
                  device=jax.devices()[0].device_kind, wall_s_median=float(np.median(walls)),
                  wall_ms_per_token=float(np.median(walls)) * 1e3 / tokens,
                  kernel_ms_per_token=busy_ms / tokens, kernels_per_token=len(ops) / tokens, lines=lines,
                  top_ops=[dict(op=k, ms_per_token=round(v[0] / 1e6 / tokens, 4), calls_per_token=v[1] / tokens)
                           for k, v in top])
    print(json.dumps(report, indent=1))
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

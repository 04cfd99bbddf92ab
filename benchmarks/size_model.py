"""The sizing advisor: `python -m benchmarks.size_model [--hardware mi300x|h200|FILE|DIR] [--model zaya1_base]
[--seq-len 4096] [--devices 1024] [--global-batch-tokens N] [--recipe paper|zaya_jax] [--json FILE]`.

--hardware takes a preset, a hardware.json written by `python -m benchmarks.characterize all`, or the sweep JSON
files / directory it wrote (laid over the preset their device names), e.g.
h200:benchmarks/results/h200_hbm.json,benchmarks/results/h200_gemm.json (one H200's sweeps).
The rules and the memory model live in benchmarks/systems/advisor.py and memory_model.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from launch._cli import ArgumentParser, user_errors


@user_errors("benchmarks.size_model")
def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.size_model", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="mi300x")
    ap.add_argument("--model", default="zaya1_base", help="model preset")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--global-batch-tokens", type=int, default=None)
    ap.add_argument("--tokenizer-vocab", type=int, default=None, help="the tokenizer's size, before padding")
    ap.add_argument("--recipe", choices=("paper", "zaya_jax"), default="paper")
    ap.add_argument("--json", default=None, help="also write the recommendation here")
    args = ap.parse_args(argv)

    from zaya_jax.config import preset
    from benchmarks.systems import advisor, hardware, memory_model

    cfg = preset(args.model)
    recipe = memory_model.PAPER if args.recipe == "paper" else memory_model.zaya_jax_recipe(cfg)
    rec = advisor.recommend(cfg, hardware.load(args.hardware),
                            advisor.Target(args.seq_len, args.devices, args.global_batch_tokens), recipe=recipe,
                            tokenizer_vocab=args.tokenizer_vocab)
    print(advisor.describe(rec))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0 if rec["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())

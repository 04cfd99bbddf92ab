"""python -m launch.generate --checkpoint PATH --prompt TEXT [--prompt TEXT ...] : text from a checkpoint.

PATH: a Hugging Face ZAYA directory (config.json + safetensors) or an Orbax training run (its workdir or
checkpoints/ folder; --step picks a step, default the latest). Prompts are batched with left padding; greedy by
default, --temperature/--top-k/--top-p sample (--seed). Generation stops at the tokenizer's EOS (or --stop-token)
or after --max-new-tokens.

  python -m launch.generate --checkpoint runs/default --prompt "def main(" --max-new-tokens 64
  python -m launch.generate --checkpoint ZAYA1_DIR --prompt "The capital of France is" --temperature 0.7 --top-p 0.9
"""

import argparse
import sys

import jax

from zaya_jax.data.tokenizer import load_tokenizer
from zaya_jax.config import COMPUTE_DTYPES
from zaya_jax.inference import Decoder, Sampling
from zaya_jax.inference.loading import load_model, matmul_precision
from zaya_jax.inference.text import complete
from zaya_jax.train.run_record import default_tokenizer

from launch._cli import ArgumentParser, UsageError, quiet_checkpoint_reads, user_errors


@user_errors("launch.generate")
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="HF directory or Orbax run/checkpoints folder")
    ap.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    ap.add_argument("--tokenizer", default=None, help="'byte', tokenizer.json or a folder holding one (default: "
                    "the checkpoint folder for HF directories, else the run's recorded tokenizer, DIR/run.json)")
    ap.add_argument("--step", type=int, default=None, help="Orbax checkpoint step (default: latest)")
    ap.add_argument("--dtype", default="float32", choices=COMPUTE_DTYPES,
                    help="compute dtype (the parameters are held in it; float16 computes from fp32 ones)")
    ap.add_argument("--kernels", choices=["auto", "xla"], default="auto", help="auto: the platform's fast kernels "
                    "(Pallas on GPU), xla: the XLA implementations (zaya_jax/inference/kernels.py)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-token", type=int, action="append", default=None,
                    help="token id that ends a row (repeatable; default: the tokenizer's EOS)")
    args = ap.parse_args(argv)
    quiet_checkpoint_reads()
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        model = load_model(args.checkpoint, dtype=args.dtype, step=args.step)
    except ValueError as e:  # sampling values, --step of an HF directory (user_errors reports checkpoint errors)
        raise UsageError(str(e)) from e
    tokenizer = load_tokenizer(args.tokenizer or default_tokenizer(args.checkpoint))
    longest = max(len(tokenizer.encode(p)) for p in args.prompt) + args.max_new_tokens
    if longest > model.cfg.max_position_embeddings:
        print(f"launch.generate: warning: prompt + --max-new-tokens reach {longest} positions, past the model's "
              f"max_position_embeddings={model.cfg.max_position_embeddings}", file=sys.stderr)
    decoder = Decoder(model, kernels=args.kernels)
    del model  # the decoder holds its own per-layer copy of the layer weights: free the stacked ones
    with matmul_precision(args.dtype):
        texts = complete(decoder, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                         key=jax.random.key(args.seed), stop_tokens=args.stop_token)
    for prompt, text in zip(args.prompt, texts):
        print(f"{prompt}{text}")
    return texts


if __name__ == "__main__":
    main()

"""python -m launch.convert_hf : Hugging Face ZAYA checkpoints in and out of zaya-jax.

  python -m launch.convert_hf HF_DIR --check               load, print parameter counts and a logits checksum
  python -m launch.convert_hf HF_DIR --roundtrip OUT_DIR   load and export again as a HF directory, with
      HF_DIR's tokenizer files and generation_config.json (written from config.json where HF_DIR has none)
  python -m launch.convert_hf --count zaya1_8b             parameter counts of a preset (nothing allocated)
  python -m launch.convert_hf RUN --export OUT_DIR [--step N]   a training run as a HF directory: config.json,
      safetensors, the run's tokenizer (tokenizer.json + tokenizer_config.json) and generation_config.json
"""

import argparse
import sys

import jax.numpy as jnp

from zaya_jax.checkpoint.errors import ZayaCheckpointError
from zaya_jax.checkpoint.export import copy_side_files, export_run
from zaya_jax.checkpoint.hf import (DEFAULT_MAX_SHARD_BYTES, ExistingWeightsError, check_export_target, from_hf,
                                    stored_dtype, to_hf)
from zaya_jax.checkpoint.hf_check import check_report
from zaya_jax.checkpoint.manager import CheckpointError
from zaya_jax.config import COMPUTE_DTYPES, PRESETS, preset
from zaya_jax.param_count import abstract_param_counts, format_param_counts

from launch._cli import ArgumentParser, quiet_checkpoint_reads, user_errors


def _message(e: Exception) -> str:
    if isinstance(e, ExistingWeightsError):
        return e.hint("--overwrite")  # the library's message names overwrite=True
    if isinstance(e, OSError) and e.filename is not None:  # an OUT_DIR that cannot be written
        return f"{e.filename}: {e.strerror or e}"
    return str(e)


@user_errors("launch.convert_hf")
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", nargs="?", help="HF ZAYA directory (config.json + safetensors); with --export a "
                    "training run directory")
    ap.add_argument("--export", metavar="OUT_DIR", help="export the run's checkpoint with its tokenizer to OUT_DIR")
    ap.add_argument("--step", type=int, default=None, help="--export: checkpoint step (default: latest)")
    ap.add_argument("--tokenizer", default=None, help="--export: tokenizer (default: the run's, from run.json)")
    ap.add_argument("--check", action="store_true", help="print parameter counts and a logits checksum")
    ap.add_argument("--roundtrip", metavar="OUT_DIR", help="export the loaded model to OUT_DIR")
    ap.add_argument("--count", choices=sorted(PRESETS), help="print the parameter counts of a preset")
    ap.add_argument("--dtype", default="float32", choices=COMPUTE_DTYPES,
                    help="compute dtype for --check")
    ap.add_argument("--save-dtype", default=None, help="dtype of the exported tensors (default: the dtype "
                    "HF_DIR's config.json declares, else as loaded)")
    ap.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    ap.add_argument("--overwrite", action="store_true", help="replace weights already in OUT_DIR")
    args = ap.parse_args(argv)

    if args.count:
        print(f"{args.count}: {format_param_counts(abstract_param_counts(preset(args.count)))}")
    if args.hf_dir is None:
        if not args.count:
            ap.error("give HF_DIR (with --check and/or --roundtrip) or --count PRESET")
        return
    if args.export:
        quiet_checkpoint_reads()
        try:
            out = export_run(args.hf_dir, args.export, step=args.step, tokenizer=args.tokenizer,
                             dtype=args.save_dtype, max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
        except (ValueError, ZayaCheckpointError, CheckpointError, OSError) as e:
            sys.exit(f"convert_hf: {_message(e)}")
        print(f"exported to {out}")
        return out
    if not (args.check or args.roundtrip):
        ap.error("HF_DIR needs --check and/or --roundtrip OUT_DIR")
    try:
        if args.roundtrip:  # before the model is loaded: a refused OUT_DIR fails at once
            check_export_target(args.roundtrip, source=args.hf_dir, overwrite=args.overwrite)
        model = from_hf(args.hf_dir, dtype=jnp.dtype(args.dtype))
        if args.check:
            print(check_report(model))
        if args.roundtrip:
            save_dtype = args.save_dtype or stored_dtype(args.hf_dir)
            out = to_hf(model, args.roundtrip, dtype=save_dtype and jnp.dtype(save_dtype),
                        max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
            if "tokenizer.json" not in copy_side_files(args.hf_dir, out, model.cfg):
                print(f"convert_hf: {args.hf_dir} has no tokenizer.json, so neither has {out} (AutoTokenizer "
                      "cannot load it; launch.generate needs --tokenizer)", file=sys.stderr)
            print(f"exported to {out}")
    except (ZayaCheckpointError, OSError) as e:
        sys.exit(f"convert_hf: {_message(e)}")

if __name__ == "__main__":
    main()

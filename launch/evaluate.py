"""python -m launch.evaluate --workdir DIR [--step N] [--max_batches K] [--config configs/X.py]

Scores a training checkpoint (loss and perplexity per held-out source) with the run's own config: the one recorded
in DIR/run.json, unless --config names another."""

import functools
import json
import os
import sys

from absl import flags, logging

from launch._cli import flag_errors, run_absl

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")
with flag_errors("launch.evaluate"):  # ml_collections applies --config.x overrides here
    from zaya_jax.train.cli_config import define_config_flag
    define_config_flag(_DEFAULT, sys.argv, "runs/default",
                       "ml-collections config file (default: the run's recorded one, else configs/default.py)")
flags.DEFINE_string("workdir", "runs/default", "run directory holding checkpoints/")
flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
flags.DEFINE_integer("max_batches", None, "eval batches per source (default: the run's train.eval_batches, as "
                     "training's evaluation; a large number: all)")


def main(argv, open_flags=None):
    logging.set_verbosity(logging.WARNING)
    from zaya_jax.train import run_record
    from zaya_jax.train.cli_config import OpenFlags, command_line_config
    from zaya_jax.train.loop import evaluate_checkpoint
    F = flags.FLAGS
    if not F["config"].present:  # never the default config's built-in corpus for a run that did not record one
        run_record.load_config(F.workdir)  # raises: DIR has no run.json; pass --config
    config = command_line_config(F["config"], open_flags or OpenFlags(), F.workdir)
    out = evaluate_checkpoint(config, F.workdir, step=F.step, max_batches=F.max_batches)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    from zaya_jax.train.cli_config import split_open_flags
    with flag_errors("launch.evaluate"):
        sys.argv[:], _open = split_open_flags(sys.argv)  # ml-collections reads sys.argv for its own overrides
    run_absl("launch.evaluate", functools.partial(main, open_flags=_open))

"""python -m launch.evaluate --config configs/X.py --workdir DIR [--step N] [--max_batches K]

Scores a training checkpoint (loss and perplexity per held-out source) with the run's own config."""

import json
import os

from absl import flags, logging
from ml_collections import config_flags

from launch._cli import flag_errors, run_absl

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")
with flag_errors("launch.evaluate"):  # ml_collections applies --config.x overrides here
    config_flags.DEFINE_config_file("config", _DEFAULT, "the run's ml-collections config file", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "run directory holding checkpoints/")
flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
flags.DEFINE_integer("max_batches", None, "eval batches per source (default: all)")


def main(argv):
    logging.set_verbosity(logging.WARNING)
    from zaya_jax.train.evaluate import evaluate_checkpoint
    F = flags.FLAGS
    out = evaluate_checkpoint(F.config, F.workdir, step=F.step, max_batches=F.max_batches)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_absl("launch.evaluate", main)

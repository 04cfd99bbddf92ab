"""python -m launch.train [--config configs/default.py] [--workdir runs/default] [--config.key=value ...]

Trains (or resumes, when DIR/checkpoints holds a checkpoint) with the given ml-collections config. Metrics go to
DIR/metrics.jsonl and DIR/tensorboard; checkpoints to DIR/checkpoints.
"""

import os

from absl import flags, logging
from ml_collections import config_flags

from launch._cli import flag_errors, run_absl

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")
with flag_errors("launch.train"):  # ml_collections applies --config.x overrides here
    config_flags.DEFINE_config_file("config", _DEFAULT, "ml-collections config file", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "run directory (metrics, checkpoints)")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
    from zaya_jax.train.loop import run
    last = run(flags.FLAGS.config, flags.FLAGS.workdir)
    print("final: " + " ".join(f"{k}={v:.4g}" for k, v in sorted(last.items())))


if __name__ == "__main__":
    run_absl("launch.train", main)

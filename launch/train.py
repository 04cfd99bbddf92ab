"""python -m launch.train [--config configs/default.py] [--workdir runs/default] [--config.key=value ...]

Trains (or resumes, when DIR/checkpoints holds a checkpoint) with the given ml-collections config. Metrics go to
DIR/metrics.jsonl and DIR/tensorboard; checkpoints to DIR/checkpoints; the resolved config to DIR/run.json.
Sources, weights and model fields by name: --config.data.sources.web=PREFIX --config.data.valid_sources.web=P
--config.data.weights.web=0.7 --config.model.overrides.vocab_size=1024. Without --config, a run directory that
holds run.json resumes with its recorded config (flags given change it, e.g. --config.train.steps=400).
"""

import functools
import os
import sys

from absl import flags, logging

from launch._cli import flag_errors, run_absl

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")
with flag_errors("launch.train"):  # ml_collections applies --config.x overrides here
    from zaya_jax.train.cli_config import define_config_flag
    define_config_flag(_DEFAULT, sys.argv, "runs/default",
                       "ml-collections config file (default: the run's recorded one, else configs/default.py)")
flags.DEFINE_string("workdir", "runs/default", "run directory (metrics, checkpoints)")


def main(argv, open_flags=None):
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
    from zaya_jax.train.cli_config import OpenFlags, command_line_config
    from zaya_jax.train.loop import run
    config = command_line_config(flags.FLAGS["config"], open_flags or OpenFlags(), flags.FLAGS.workdir)
    last = run(config, flags.FLAGS.workdir)
    if not last:  # e.g. a resume whose remaining steps were all skipped: no step of this process logged anything
        print(f"final: no step logged by this run (see {os.path.join(flags.FLAGS.workdir, 'metrics.jsonl')})")
        return
    print("final: " + " ".join(f"{k}={v:.4g}" for k, v in sorted(last.items()) if "/layer_" not in k))


if __name__ == "__main__":
    from zaya_jax.train.cli_config import split_open_flags
    with flag_errors("launch.train"):
        sys.argv[:], _open = split_open_flags(sys.argv)  # ml-collections reads sys.argv for its own overrides
    run_absl("launch.train", functools.partial(main, open_flags=_open))

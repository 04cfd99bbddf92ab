"""The one fact about a training run's directory that both the trainer (train/run_record.py) and the exporter
(checkpoint/hf.py) need: its run record marks it, so a folder below a run belongs to that run's trainer. Kept free of
heavy imports so that the checkpoint package does not import the trainer."""

from __future__ import annotations

from pathlib import Path

RUN_RECORD = "run.json"


def run_above(path) -> Path | None:
    """The workdir of the training run `path` lies inside, if any: a folder above it holding the run record (a
    checkpoints/ folder alone is common in projects that are not runs)."""
    return next((d for d in Path(path).absolute().parents if (d / RUN_RECORD).is_file()), None)


__all__ = ["RUN_RECORD", "run_above"]

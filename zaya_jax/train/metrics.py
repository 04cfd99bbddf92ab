"""Metric sinks: JSON lines (always) and TensorBoard (when tensorboardX is installed); throughput meter."""

from __future__ import annotations

import contextlib
import json
import os
import time


ATTEMPTS = "metrics.attempts.jsonl"  # every row of every attempt in the order logged (fault drills compare attempts)


class MetricsWriter:
    """resume_step: the step the run restored (0: a fresh start). Rows logged past it by an earlier attempt are
    dropped from metrics.jsonl and purged from TensorBoard's view, so every step appears once there; ATTEMPTS
    keeps them."""

    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        path = os.path.join(workdir, "metrics.jsonl")
        self.dropped = drop_rows_after(path, resume_step) if enabled and resume_step is not None else 0
        self._jsonl = open(path, "a") if enabled else None
        self._attempts = open(os.path.join(workdir, ATTEMPTS), "a") if enabled else None
        self._tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter
                purge = None if resume_step is None else resume_step + 1  # hides events logged at >= purge
                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge)
            except ImportError:
                pass

    def write(self, step: int, metrics: dict):
        if not self.enabled:
            return
        row = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        for f in (self._jsonl, self._attempts):
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self):
        """Idempotent; ends TensorBoard's writer thread (left running, it fails at interpreter exit)."""
        if self._jsonl:
            self._jsonl.close()
            self._attempts.close()
            self._jsonl = self._attempts = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def drop_rows_after(path: str, step: int) -> int:
    """Rewrites `path` without the rows past `step` (and any line cut short by a kill); returns how many went.
    Untouched when nothing goes. The file is replaced whole (the supervisor notices it shrank)."""
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    keep = []
    for line in lines:
        try:
            if line.endswith(b"\n") and json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except ValueError:
            pass
    if len(keep) == len(lines):
        return 0
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    return len(lines) - len(keep)


class Throughput:
    """Tokens/s over the steps since the last call (excluding the first, compiling step, and time spent inside
    `excluded()`: evaluation, checkpoint saves)."""

    def __init__(self):
        self._t, self._tokens, self._excluded = None, 0, 0.0

    @property
    def started(self) -> bool:
        return self._t is not None

    def start(self):
        self._t, self._tokens, self._excluded = time.perf_counter(), 0, 0.0

    def add(self, tokens: int):
        self._tokens += tokens

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside is not training time; yields a Timer whose .seconds holds it afterwards."""
        timer = Timer()
        try:
            with timer:
                yield timer
        finally:
            self._excluded += timer.seconds

    def rate(self) -> float | None:
        """None when no step was timed since the last call (only the compiling one ran): nothing was measured."""
        if self._t is None or not self._tokens:
            return None
        dt = time.perf_counter() - self._t - self._excluded
        r = self._tokens / dt if dt > 0 else None
        self.start()
        return r


class Timer:
    seconds = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._t0

"""Metric sinks: JSON lines (always) and TensorBoard (when tensorboardX is installed); throughput meter."""

from __future__ import annotations

import json
import os
import time


class MetricsWriter:
    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a") if enabled else None
        self._tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter
                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:
                pass

    def write(self, step: int, metrics: dict):
        if not self.enabled:
            return
        row = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self):
        if self._jsonl:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class Throughput:
    """Tokens/s over the steps since the last call (excluding the first, compiling step)."""

    def __init__(self):
        self._t, self._tokens = None, 0

    def start(self):
        self._t, self._tokens = time.perf_counter(), 0

    def add(self, tokens: int):
        self._tokens += tokens

    def rate(self) -> float:
        if self._t is None:
            return 0.0
        dt = time.perf_counter() - self._t
        r = self._tokens / dt if dt > 0 else 0.0
        self.start()
        return r

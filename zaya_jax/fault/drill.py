"""Fault drills from outside the trainer: kill -9 one rank of a supervised group once training reaches a step, and
read back what the supervisor did (the timeline of events.jsonl next to the metrics' losses)."""

from __future__ import annotations

import json
import os
import signal
import time

from zaya_jax.fault.control import EVENTS, HEARTBEAT, read_json


def read_events(workdir: str) -> list[dict]:
    try:
        with open(os.path.join(workdir, EVENTS)) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def read_attempts(workdir: str) -> list[dict[int, float]]:
    """The metrics of every attempt (metrics.attempts.jsonl; metrics.jsonl keeps only the rows that stand) split into
    the run's starts: a start after a restart logs its steps again from the checkpoint it resumed from, so a step at
    or below the previous line's begins a new attempt."""
    attempts: list[dict[int, float]] = []
    last = None
    path = os.path.join(workdir, "metrics.attempts.jsonl")
    try:
        with open(path if os.path.exists(path) else os.path.join(workdir, "metrics.jsonl")) as f:
            for line in f:
                row = json.loads(line)
                if "loss" not in row:
                    continue
                if last is None or row["step"] <= last:
                    attempts.append({})
                attempts[-1][row["step"]] = row["loss"]
                last = row["step"]
    except FileNotFoundError:
        pass
    return attempts


def read_losses(workdir: str) -> dict[int, float]:
    """step -> loss as metrics.jsonl last logged it (a restarted run logs the steps after its checkpoint again)."""
    out = {}
    for attempt in read_attempts(workdir):
        out.update(attempt)
    return out


def kill_rank_at(workdir: str, rank: int, step: int, timeout_s: float, poll_s: float = 0.05) -> dict:
    """Waits until the first start's heartbeat reports `step` or later, then SIGKILLs rank `rank` of that start.
    Returns what was done ({'killed_pid', 'rank', 'at_step', 'time'}) or, on timeout, {'error': ...}."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        starts = [e for e in read_events(workdir) if e["event"] == "start"]
        beat = read_json(os.path.join(workdir, HEARTBEAT), {}) or {}
        if starts and beat.get("step", 0) >= step and beat.get("pid") in starts[0]["pids"]:
            pids = starts[0]["pids"]
            if rank >= len(pids):
                return {"error": f"rank {rank} does not exist: the group has {len(pids)} processes"}
            os.kill(pids[rank], signal.SIGKILL)
            return {"killed_pid": pids[rank], "rank": rank, "at_step": beat["step"], "time": time.time()}
        time.sleep(poll_s)
    return {"error": f"the run did not reach step {step} within {timeout_s:.0f} s"}


def timeline(workdir: str, t0: float | None = None) -> list[dict]:
    """The supervisor's events with seconds since t0 (default: the first event)."""
    events = read_events(workdir)
    if not events:
        return []
    t0 = events[0]["time"] if t0 is None else t0
    keep = ("event", "pids", "nproc", "from_step", "how", "rank", "step", "attempt", "kind", "silent_s")
    return [{"t_s": round(e["time"] - t0, 2), **{k: e[k] for k in keep if k in e}} for e in events]

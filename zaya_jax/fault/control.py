"""The files the trainer and its supervisor share inside the run directory.

heartbeat.json   written by the trainer after every optimizer step: {"step", "time", "pid", "finishing"}
control.json     written by the supervisor before a restart: {"restore_step": int | null,
                 "skip_steps": [[first, last], ...]} (optimizer steps whose data is skipped, inclusive)
events.jsonl     the supervisor's event log, one JSON object per action
"""

from __future__ import annotations

import json
import os
import time

HEARTBEAT, CONTROL, EVENTS = "heartbeat.json", "control.json", "events.jsonl"


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def beat(workdir: str, step: int, *, finishing: bool = False, warm: bool = True) -> None:
    """finishing: the steps are over and the process is writing its last checkpoint (no step rate applies).
    warm=False: no step has run in this process yet (a skipped step's beat), so its first one, compilation
    included, is still ahead: the supervisor keeps the start-up allowance."""
    write_json_atomic(os.path.join(workdir, HEARTBEAT), {"step": int(step), "time": time.time(), "pid": os.getpid(),
                                                         "finishing": finishing, "warm": warm})


def read_control(workdir: str) -> dict:
    c = read_json(os.path.join(workdir, CONTROL), {}) or {}
    return {"restore_step": c.get("restore_step"), "skip_steps": [tuple(w) for w in c.get("skip_steps", [])]}


def skipped(step: int, windows) -> bool:
    return any(a <= step <= b for a, b in windows)

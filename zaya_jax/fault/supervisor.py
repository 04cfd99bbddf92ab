"""The supervisor: runs a training command as a child process group, watches its heartbeat and metrics, and acts.

  exit 0                      done
  crash / killed (any signal) restart from the latest finished checkpoint (retry budget, exponential backoff)
  hang                        no heartbeat for max(min_hang_s, hang_factor x median step time): SIGKILL, restart
  NaN / Inf loss              rewind: the data of every step since the last good logged row (or the checkpoint
                              the attempt started from) is skipped, checkpoints among those steps are moved aside
                              (never deleted), restart from the latest earlier checkpoint
  loss spike                  the same, when the loss sits more than spike_z robust z-scores (median/MAD of the
                              last spike_window steps) above the median
  the same failure at the     unknown: stop and notify a human instead of looping
  same step twice, no progress
  exit 0 short of the end     the trainer's last heartbeat is not its finishing one, or its final checkpoint is
                              missing: stop and say so, never `done`
Restarts: each is numbered (`attempt` in its event: 1, 2, 3, ... over the whole run); `max_restarts` bounds the
restarts in a row without progress. An attempt made progress only if it got past the furthest step any earlier one
reached (a good logged row, or a heartbeat for a crash or hang): an attempt that rewinds to a checkpoint, logs the
same good rows again and fails before the furthest step is a restart without progress, not a new start.
Several processes (`group.nproc` > 1, one host): the command runs once per rank with the jax.distributed
variables and its own devices (zaya_jax/fault/group.py); process 0 writes the heartbeat and the metrics. When any
rank dies, the others cannot finish their collectives: they are stopped (SIGTERM, SIGKILL after peer_grace_s) and
the whole group restarts from the latest finished checkpoint, at the data position saved with it.
Devices: before each restart `devices_cmd` (if given) prints how many devices are usable; the trainer restarts on
those (one process: ZAYA_NUM_DEVICES, restoring the same logical checkpoint onto the smaller mesh with the same
global batch; a group: as many ranks as the usable devices fill).
Every action is a line in WORKDIR/events.jsonl and is passed (as JSON on stdin) to `notify_cmd`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

from zaya_jax.fault.control import (
    CONTROL,
    EVENTS,
    HEARTBEAT,
    read_control,
    read_json,
    write_json_atomic,
)
from zaya_jax.fault.group import GroupSpec, ProcessGroup
from zaya_jax.train.metrics import drop_rows_after

EXIT_NONFINITE = 65  # zaya_jax.train.loop.EXIT_NONFINITE (not imported: the supervisor must not load jax)


@dataclasses.dataclass
class SupervisorConfig:
    workdir: str
    command: list[str]
    max_restarts: int = 5
    backoff_s: float = 1.0  # doubles after each consecutive failure, capped at 60 s
    hang_factor: float = 10.0
    min_hang_s: float = 60.0  # between heartbeats
    startup_s: float = 900.0  # before the first heartbeat of a (re)start: imports, restore, compilation
    spike_window: int = 50
    spike_z: float = 8.0
    spike_min_steps: int = 20  # no spike verdicts before this many logged steps
    skip_window: int = 1  # optimizer steps of data to skip, ending at the bad step
    poll_s: float = 0.5
    stop_grace_s: float = 60.0  # SIGTERM -> SIGKILL: time for the trainer to finish writing a checkpoint
    notify_cmd: str | None = None
    devices_cmd: str | None = None
    group: GroupSpec = dataclasses.field(default_factory=GroupSpec)  # processes (ranks) and their devices
    peer_grace_s: float = 5.0  # SIGTERM -> SIGKILL for the ranks left when one died (stuck in collectives)


class Supervisor:
    def __init__(self, cfg: SupervisorConfig):
        self.cfg = cfg
        os.makedirs(cfg.workdir, exist_ok=True)
        self.events_path = os.path.join(cfg.workdir, EVENTS)
        self.metrics_path = os.path.join(cfg.workdir, "metrics.jsonl")

    # ---- bookkeeping ----------------------------------------------------------------------------------------------
    def event(self, name: str, /, **detail) -> dict:
        row = {"time": time.time(), "event": name, **detail}
        with open(self.events_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.cfg.notify_cmd and name in ("restart", "rewind", "hang", "gave_up", "unknown_failure"):
            subprocess.run(self.cfg.notify_cmd, shell=True, input=json.dumps(row), text=True, check=False)
        return row

    def _losses(self, offset: int) -> tuple[list[tuple[int, float]], int]:
        """(step, loss) rows appended to metrics.jsonl since byte `offset`, and the new offset (at most the file's
        size: a trainer that fell back past an unreadable checkpoint drops more rows itself)."""
        rows = []
        try:
            with open(self.metrics_path, "rb") as f:
                offset = min(offset, os.fstat(f.fileno()).st_size)
                f.seek(offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    offset += len(line)
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if "loss" in r:
                        rows.append((r["step"], r["loss"]))
        except FileNotFoundError:
            pass
        return rows, offset

    def _checkpoint_steps(self) -> list[int]:
        d = os.path.join(self.cfg.workdir, "checkpoints")
        if not os.path.isdir(d):
            return []
        return sorted(int(n) for n in os.listdir(d) if n.isdigit())

    def _restart_offset(self, history: list) -> int:
        """Before a (re)start: rows logged past the latest checkpoint go (the trainer resumes there, logs those
        steps again and would drop them itself); returns the offset where reading goes on."""
        resume = max(self._checkpoint_steps(), default=0)
        drop_rows_after(self.metrics_path, resume)
        history[:] = [(st, x) for st, x in history if st <= resume]
        try:
            return os.path.getsize(self.metrics_path)
        except FileNotFoundError:
            return 0

    def _say(self, line: str):
        print(f"supervisor: {line} (events: {self.events_path})", file=sys.stderr, flush=True)

    # ---- actions --------------------------------------------------------------------------------------------------
    def rewind(self, bad_step: int, reason: str, first_suspect: int | None = None):
        """Move checkpoints inside the bad window aside and mark its data to be skipped: skip_window steps ending at
        bad_step, and every step from first_suspect on (a logged row averages the steps since the last one, so a
        NaN row at step 10 with log_every 2 may come from step 9)."""
        first = bad_step - self.cfg.skip_window + 1
        window = [max(1, min(first, bad_step if first_suspect is None else first_suspect)), bad_step]
        aside = os.path.join(self.cfg.workdir, "rewound", time.strftime("%Y%m%d-%H%M%S"))
        moved = []
        for s in self._checkpoint_steps():  # a checkpoint inside the window may hold the bad weights
            if s >= window[0]:
                os.makedirs(aside, exist_ok=True)
                shutil.move(os.path.join(self.cfg.workdir, "checkpoints", str(s)), os.path.join(aside, str(s)))
                moved.append(s)
        control = read_control(self.cfg.workdir)
        control["skip_steps"] = [list(w) for w in control["skip_steps"]] + [window]
        write_json_atomic(os.path.join(self.cfg.workdir, CONTROL), control)
        resume = max(self._checkpoint_steps(), default=0)
        self.event("rewind", reason=reason, bad_step=bad_step, resume_from=resume, skip_steps=window,
                   moved_checkpoints=moved, moved_to=aside if moved else None)

    def _devices_env(self) -> tuple[dict, int]:
        """The environment and the number of ranks of the next start."""
        env, group = dict(os.environ), self.cfg.group
        nproc = group.nproc
        if self.cfg.devices_cmd:
            out = subprocess.run(self.cfg.devices_cmd, shell=True, capture_output=True, text=True, check=False)
            n = out.stdout.strip()
            if n.isdigit() and int(n) > 0:
                if group.nproc == 1:
                    env["ZAYA_NUM_DEVICES"] = n
                else:  # whole ranks only: each rank keeps its devices_per_process
                    nproc = max(1, min(group.nproc, int(n) // group.devices_per_process))
        return env, nproc

    # ---- the watch loop -------------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        restarts, in_a_row, backoff = 0, 0, cfg.backoff_s  # all restarts; those since the last progress
        last_failure = None
        history: list[tuple[int, float]] = []  # (step, loss) of recent good steps, for the spike statistics
        self.reached = max(self._checkpoint_steps(), default=0)  # the furthest step known good of any attempt
        while True:
            env, nproc = self._devices_env()
            hb_path = os.path.join(cfg.workdir, HEARTBEAT)
            start_beat = read_json(hb_path, {}) or {}
            offset = self._restart_offset(history)
            started = time.time()
            group = ProcessGroup(cfg.command, cfg.group, env, nproc)
            self.event("start", pid=group.pids[0], pids=group.pids, nproc=nproc, command=cfg.command,
                       devices=env.get("ZAYA_NUM_DEVICES"), from_step=start_beat.get("step"))
            verdict = self._watch(group, hb_path, start_beat, offset, history, started)
            verdict.pop("offset")
            reached = verdict.pop("reached", None)
            progressed = reached is not None and reached > self.reached
            if progressed:
                self.reached = reached
            if verdict["kind"] == "done":
                self.event("done", step=verdict.get("step"))
                return 0
            if verdict["kind"] == "incomplete":
                self.event("gave_up", restarts=restarts, **verdict)
                self._say(f"stopping: {_describe(verdict)}; the run did not reach its last step, not reporting it "
                          "done")
                return 1
            step = verdict.get("step")
            signature = (verdict["kind"], step)
            if signature == last_failure and verdict["kind"] in ("crash", "nonfinite"):
                self.event("unknown_failure", **verdict)
                self._say(f"stopping: the same failure twice without progress ({_describe(verdict)}); it needs a "
                          "human")
                return 2
            last_failure = signature
            if progressed:
                in_a_row, backoff = 0, cfg.backoff_s
            if in_a_row >= cfg.max_restarts:
                self.event("gave_up", restarts=restarts, without_progress=in_a_row, **verdict)
                self._say(f"gave up after {in_a_row} restarts without progress past step {self.reached} "
                          f"(--max-restarts {cfg.max_restarts}); last failure: {_describe(verdict)}")
                return 1
            if verdict["kind"] in ("nonfinite", "spike"):
                self.rewind(verdict["bad_step"], verdict["kind"], verdict.get("first_suspect"))
                history[:] = [(st, x) for st, x in history if st < verdict["bad_step"]]
            restarts += 1
            in_a_row += 1
            self.event("restart", attempt=restarts, without_progress=in_a_row, backoff_s=backoff, **verdict)
            time.sleep(backoff)
            backoff = min(60.0, backoff * 2)

    def _watch(self, group: ProcessGroup, hb_path, start_beat, offset, history, started=0.0) -> dict:
        """Watches one attempt to its end; returns the verdict: its kind, the step it concerns, and `reached`: the
        furthest step it got to that is known good (its last good row; for a crash, hang or exit, its last
        heartbeat), which run() compares with every earlier attempt's to tell progress."""
        cfg = self.cfg
        beats: list[tuple[float, int]] = []
        last_seen = time.time()
        seen_step = start_beat.get("step")
        # the last step known good: the checkpoint this attempt resumes from, then each finite logged row; a bad row
        # may come from any step after it
        resumed = last_good = max(self._checkpoint_steps(), default=0)

        def own_beat():
            """The step of this attempt's latest heartbeat, or None (the file may still hold an earlier attempt's,
            and that one may be past the checkpoint this attempt resumed from)."""
            hb = read_json(hb_path, {}) or {}
            return hb.get("step") if hb.get("time", 0.0) >= started else None

        def bad(kind, step, **detail):
            step = max(step, last_good + 1)
            return {"kind": kind, "bad_step": step, "first_suspect": last_good + 1, "step": step, "offset": offset,
                    "reached": last_good, **detail}

        while True:
            rows, offset = self._losses(offset)
            for step, loss in rows:
                if not math.isfinite(loss):
                    group.stop(cfg.stop_grace_s)
                    return bad("nonfinite", step)
                if self._is_spike(loss, [x for _, x in history]):
                    group.stop(cfg.stop_grace_s)
                    return bad("spike", step, loss=loss)
                last_good = step
                history.append((step, loss))
                del history[:-cfg.spike_window]
            hb = read_json(hb_path, {}) or {}
            finishing = hb.get("finishing", False) and hb.get("pid") in group.pids
            if hb.get("step") is not None and hb.get("step") != seen_step:
                seen_step = hb["step"]
                now = time.time()
                if hb.get("warm", True):  # a skipped step's beat before the first trained one keeps start-up time
                    beats.append((now, seen_step))
                last_seen = now
            code = group.poll()
            if code is not None:
                group.stop(cfg.peer_grace_s)  # the ranks still running wait on the dead one's collectives
                rows, offset = self._losses(offset)
                for s, x in rows:
                    if not math.isfinite(x):
                        return bad("nonfinite", s)
                    last_good = s
                # read again: the process may have beaten (and exited) after this round's read above
                beat_step = own_beat()
                if beat_step is not None:
                    seen_step = beat_step
                reached = max(last_good, beat_step or 0)
                if code == 0:
                    return self._finished(offset, reached, started)
                if code == EXIT_NONFINITE:
                    # the trainer stops at a non-finite row before that step's heartbeat, after its row: a row
                    # not read (a rank that does not log, a row cut short) is the step after its last heartbeat
                    return bad("nonfinite", (resumed if beat_step is None else beat_step) + 1)
                how = f"signal {-code}" if code < 0 else f"exit {code}"
                where = {"rank": group.failed[0]} if group.nproc > 1 else {}
                return {"kind": "crash", "how": how, **where, "step": seen_step, "offset": offset,
                        "reached": reached}
            timeout = self._hang_timeout(beats) if beats and not finishing else cfg.startup_s
            if time.time() - last_seen > timeout:
                self.event("hang", step=seen_step, silent_s=round(time.time() - last_seen, 1),
                           timeout_s=round(timeout, 1))
                group.stop(0.0)  # a hung main thread never reaches its stop check: no grace
                return {"kind": "hang", "step": seen_step, "offset": offset,
                        "reached": max(last_good, own_beat() or 0)}
            time.sleep(cfg.poll_s)

    def _finished(self, offset: int, reached: int, started: float) -> dict:
        """The verdict of an exit 0: done, or incomplete when this attempt's last heartbeat is not its finishing one
        (it stopped short of its last step) or the step of the finishing heartbeat has no checkpoint. A command that
        writes no heartbeat, or a trainer that found the run already trained (no heartbeat of its own), is taken at
        its word."""
        hb = read_json(os.path.join(self.cfg.workdir, HEARTBEAT), {}) or {}
        step, latest = hb.get("step"), max(self._checkpoint_steps(), default=None)
        verdict = {"step": step, "offset": offset, "reached": reached}
        if step is not None and hb.get("time", 0.0) >= started and not hb.get("finishing", False):
            return {"kind": "incomplete", "how": "exit 0 before its last step", **verdict}
        if step is not None and hb.get("finishing", False) and (latest is None or latest < step):
            return {"kind": "incomplete", "how": f"exit 0 without its final checkpoint; the latest is {latest}",
                    **verdict}
        return {"kind": "done", **verdict}

    def _hang_timeout(self, beats) -> float:
        if len(beats) < 3:
            return self.cfg.min_hang_s
        gaps = [b[0] - a[0] for a, b in zip(beats, beats[1:])]
        return max(self.cfg.min_hang_s, self.cfg.hang_factor * statistics.median(gaps))

    def _is_spike(self, loss: float, history: list[float]) -> bool:
        if len(history) < self.cfg.spike_min_steps:
            return False
        med = statistics.median(history)
        mad = statistics.median(abs(x - med) for x in history) or 1e-6
        return (loss - med) / (1.4826 * mad) > self.cfg.spike_z


def _describe(verdict: dict) -> str:
    """One failure verdict of _watch in words, e.g. 'crash (exit 1) before the first step'."""
    kind, step = verdict["kind"], verdict.get("step")
    how = f" ({verdict['how']})" if verdict.get("how") else ""
    where = f" at step {step}" if step is not None else " before the first step"
    return f"{kind}{how}{where}"

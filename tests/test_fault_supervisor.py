"""The supervisor's restarts, rewinds and hang detection over a stand-in trainer (tests/fault_configs/
standin_trainer.py: the trainer's heartbeat, control file and fault injection, no jax; seconds per run).

The same drills over the real trainer (kill -9 mid-step and mid-save, a crash and a restart on fewer devices, NaN,
spike, hang) are tests/test_fault_tolerance.py, marked slow. The default run checks the real trainer's side of them
in-process: skipped data, the spike and NaN faults and the heartbeat (tests/test_train.py), a resume on fewer
devices from ZAYA_NUM_DEVICES (tests/test_parallel_train.py)."""

import json
import os
import sys

from zaya_jax.fault.supervisor import Supervisor, SupervisorConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "fault_configs", "standin_trainer.py")
STEPS = 10


def supervise(workdir, faults, monkeypatch, steps=STEPS, checkpoint_every=2, log_every=1, **kw):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the stand-in imports zaya_jax.fault
    command = [sys.executable, STANDIN, str(workdir), faults, str(steps), str(checkpoint_every), str(log_every)]
    cfg = SupervisorConfig(workdir=str(workdir), command=command, backoff_s=0.1, poll_s=0.1, stop_grace_s=5.0,
                           spike_min_steps=3, spike_z=8.0, **kw)
    return Supervisor(cfg).run()


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def checkpoints(workdir):
    return sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())


def test_kills_and_a_crash_restart_from_the_latest_finished_checkpoint_on_the_usable_devices(tmp_path, monkeypatch):
    wd = tmp_path / "run"
    devices = tmp_path / "devices"
    devices.write_text("8")
    # after the crash at step 7 only 4 devices are left: the restart must say so to the trainer
    cmd = f"[ -e {wd}/.fault_crash_7 ] && echo 4 > {devices}; cat {devices}"
    assert supervise(wd, "kill@3,killsave@4,crash@7", monkeypatch, devices_cmd=cmd) == 0
    ev = rows(wd / "events.jsonl")
    assert [r["how"] for r in ev if r["event"] == "restart"] == ["signal 9", "signal 9", "exit 3"]
    assert [e.get("devices") for e in ev if e["event"] == "start"] == ["8", "8", "8", "4"]
    assert ev[-1]["event"] == "done"
    standin = rows(wd / "standin.jsonl")
    starts = [r for r in standin if r["event"] == "start"]
    # killed in step 3 (checkpoint 2), killed while saving 4 (the unfinished save is not a checkpoint), crashed
    # after 7 (checkpoint 6)
    assert [(r["resumed_from"], r["devices"]) for r in starts] == [(0, "8"), (2, "8"), (2, "8"), (6, "4")]
    assert standin[-1] == {"event": "end", "trained": list(range(1, STEPS + 1))}  # as if never interrupted
    assert checkpoints(wd) == [2, 4, 6, 8, 10]


def test_nan_spike_and_hang_are_rewound_skipped_and_restarted(tmp_path, monkeypatch):
    wd = tmp_path / "run"
    assert supervise(wd, "hang@3,nan@5,spike@8", monkeypatch, min_hang_s=1.0, startup_s=60.0) == 0
    ev = rows(wd / "events.jsonl")
    rewinds = [e for e in ev if e["event"] == "rewind"]
    assert [(r["reason"], r["bad_step"], r["resume_from"], r["skip_steps"]) for r in rewinds] == [
        ("nonfinite", 5, 4, [5, 5]), ("spike", 8, 6, [8, 8])]
    # the spiked step's checkpoint is moved aside, not deleted; the NaN step never saved one
    assert [r["moved_checkpoints"] for r in rewinds] == [[], [8]]
    assert os.listdir(rewinds[1]["moved_to"]) == ["8"]
    hangs = [e for e in ev if e["event"] == "hang"]
    # detected at its hang timeout (max(min_hang_s, hang_factor x median step gap)), not at the 60 s start-up
    # allowance
    assert [h["step"] for h in hangs] == [3] and 1.0 <= hangs[0]["timeout_s"] < 30.0
    assert hangs[0]["silent_s"] < hangs[0]["timeout_s"] + 5.0  # polled every 0.1 s; slack for a loaded CI machine
    assert [e["event"] for e in ev].count("restart") == 3 and ev[-1]["event"] == "done"
    standin = rows(wd / "standin.jsonl")
    assert [r["resumed_from"] for r in standin if r["event"] == "start"] == [0, 2, 4, 6]
    # the bad steps' data is skipped by every later start: trained on everything else, once
    assert standin[-1]["trained"] == [s for s in range(1, STEPS + 1) if s not in (5, 8)]
    assert checkpoints(wd) == [2, 4, 6, 8, 10]  # the skipped step 8 counts as done: its checkpoint is 6's weights


def test_a_nan_seen_in_a_row_of_several_steps_skips_every_step_of_the_row(tmp_path, monkeypatch):
    """log_every 2: the NaN of step 9 shows in the row of step 10. Every step after the last good row is skipped
    ([9, 10]), and the run ends at its last step with every other step trained once (only [10, 10] was skipped
    before: step 9 poisoned each restart again, the rewinds marched to the end and the run was reported done
    without a checkpoint past 8)."""
    wd = tmp_path / "run"
    assert supervise(wd, "nan@9", monkeypatch, steps=12, checkpoint_every=4, log_every=2, max_restarts=2) == 0
    ev = rows(wd / "events.jsonl")
    rewinds = [e for e in ev if e["event"] == "rewind"]
    assert [(r["bad_step"], r["resume_from"], r["skip_steps"]) for r in rewinds] == [(10, 8, [9, 10])]
    assert [e["attempt"] for e in ev if e["event"] == "restart"] == [1] and ev[-1]["event"] == "done"
    assert rows(wd / "standin.jsonl")[-1]["trained"] == [*range(1, 9), 11, 12]
    logged = [r["step"] for r in rows(wd / "metrics.jsonl")]
    assert logged == [2, 4, 6, 8, 12] and checkpoints(wd) == [4, 8, 12]

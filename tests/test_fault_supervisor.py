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


def test_rewinds_that_fail_again_short_of_the_furthest_step_count_as_restarts(tmp_path, monkeypatch):
    """log_every 2, checkpoints every 8: the NaN of step 11 shows in the row of step 12, that of step 13 (met once
    [11, 12] is skipped) in the row of 14. The second attempt logs row 10 again but gets no further than the first:
    its restart is the second without progress (restarts were numbered 1, 1, ... before: re-logging the rows past
    the checkpoint counted as progress, so --max-restarts never held)."""
    wd = tmp_path / "run"
    assert supervise(wd, "nan@11,nan@13", monkeypatch, steps=16, checkpoint_every=8, log_every=2,
                     max_restarts=2) == 0
    ev = rows(wd / "events.jsonl")
    rewinds = [e for e in ev if e["event"] == "rewind"]
    # every window reaches back to the step after the last good row (10): each NaN step is inside one
    assert [(r["bad_step"], r["resume_from"], r["skip_steps"]) for r in rewinds] == [(12, 8, [11, 12]),
                                                                                       (14, 8, [11, 14])]
    restarts = [e for e in ev if e["event"] == "restart"]
    assert [e["attempt"] for e in restarts] == [1, 2] and [e["without_progress"] for e in restarts] == [1, 2]
    assert ev[-1] == {**ev[-1], "event": "done", "step": 16}
    assert rows(wd / "standin.jsonl")[-1]["trained"] == [*range(1, 11), 15, 16]
    logged = [r["step"] for r in rows(wd / "metrics.jsonl")]
    assert logged == [2, 4, 6, 8, 10, 16] and checkpoints(wd) == [8, 16]  # each row once, the final checkpoint


def test_restarts_without_progress_run_out_and_the_supervisor_says_so(tmp_path, monkeypatch, capsys):
    """A third NaN (step 15) before the run gets past step 10: the third restart without progress is over
    --max-restarts 2: the supervisor gives up with one line, not `done` (it marched on to the end and reported
    done before)."""
    wd = tmp_path / "run"
    assert supervise(wd, "nan@11,nan@13,nan@15", monkeypatch, steps=18, checkpoint_every=8, log_every=2,
                     max_restarts=2) == 1
    ev = rows(wd / "events.jsonl")
    assert [e["attempt"] for e in ev if e["event"] == "restart"] == [1, 2]
    assert [e["event"] for e in ev].count("done") == 0
    assert ev[-1] == {**ev[-1], "event": "gave_up", "kind": "nonfinite", "bad_step": 16, "without_progress": 2}
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("supervisor:")]
    assert len(said) == 1 and "gave up after 2 restarts without progress past step 10 (--max-restarts 2)" in said[0]
    assert "nonfinite at step 16" in said[0]


# A trainer whose non-finite row never reaches metrics.jsonl (a rank that does not log, a row cut short): only its
# exit status (65) tells the NaN. Steps log every LOG_EVERY, checkpoint every 2; the NaN step poisons later ones.
EXIT_ONLY = """
import json, math, os, sys
from zaya_jax.fault.control import beat, read_control, skipped
workdir, steps, log_every, nan_step = sys.argv[1], *map(int, sys.argv[2:5])
ckpts = os.path.join(workdir, "checkpoints")
os.makedirs(ckpts, exist_ok=True)
start = max((int(n) for n in os.listdir(ckpts) if n.isdigit()), default=0)
skip = read_control(workdir)["skip_steps"]
window, poisoned = [], False
for step in range(start + 1, steps + 1):
    if not skipped(step, skip):
        poisoned |= step == nan_step
        window.append(math.nan if poisoned else 1.0)
    if window and step % log_every == 0:
        if poisoned:
            os._exit(65)
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": sum(window) / len(window)}) + "\\n")
        window = []
    beat(workdir, step)
    if step % 2 == 0 or step == steps:
        os.makedirs(os.path.join(ckpts, str(step)))
beat(workdir, steps, finishing=True)
"""


def run_script(workdir, script, monkeypatch, *args, **kw):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    path = workdir.parent / f"{workdir.name}_script.py"
    path.write_text(script)
    cfg = SupervisorConfig(workdir=str(workdir), command=[sys.executable, str(path), str(workdir), *map(str, args)],
                           backoff_s=0.05, poll_s=0.05, stop_grace_s=5.0, max_restarts=2, **kw)
    return Supervisor(cfg).run()


def test_a_nan_only_the_exit_status_tells_skips_the_steps_since_the_last_good_row(tmp_path, monkeypatch):
    """Exit 65 without the row: the trainer stops at the row before that step's heartbeat, so the bad row is the
    step after this attempt's last heartbeat, and the window runs from the step after the last good row."""
    wd = tmp_path / "every2"  # NaN at 5, rows at 2, 4, then 6 (not logged): [5, 6]
    assert run_script(wd, EXIT_ONLY, monkeypatch, 8, 2, 5) == 0
    ev = rows(wd / "events.jsonl")
    assert [(e["bad_step"], e["resume_from"], e["skip_steps"]) for e in ev if e["event"] == "rewind"] == [
        (6, 4, [5, 6])]
    assert ev[-1]["event"] == "done" and [r["step"] for r in rows(wd / "metrics.jsonl")] == [2, 4, 8]
    # a run killed at step 9 after its checkpoint 4, then supervised: the heartbeat file still says 9 when the
    # first attempt stops at the row of step 5, before any heartbeat of its own (the window was [5, 10] before)
    wd = tmp_path / "stale"
    (wd / "checkpoints" / "4").mkdir(parents=True)
    (wd / "heartbeat.json").write_text(json.dumps({"step": 9, "time": 1.0, "pid": 1, "finishing": False}))
    assert run_script(wd, EXIT_ONLY, monkeypatch, 8, 1, 5) == 0
    ev = rows(wd / "events.jsonl")
    assert [(e["bad_step"], e["resume_from"], e["skip_steps"]) for e in ev if e["event"] == "rewind"] == [
        (5, 4, [5, 5])]
    assert ev[-1]["event"] == "done" and [r["step"] for r in rows(wd / "metrics.jsonl")] == [6, 7, 8]


# A trainer that exits 0 short of its end: its heartbeat is not the finishing one, or the finishing heartbeat's step
# has no checkpoint (the trainer skipped the last steps' data and did not save them).
EXIT_0 = """
import os, sys
from zaya_jax.fault.control import beat
workdir, finishing = sys.argv[1], sys.argv[2] == "finishing"
for step in (4, 8):
    os.makedirs(os.path.join(workdir, "checkpoints", str(step)), exist_ok=True)
beat(workdir, 20 if finishing else 12, finishing=finishing)
"""


def test_an_exit_0_short_of_the_last_step_or_its_checkpoint_is_not_done(tmp_path, monkeypatch, capsys):
    for how, said in (("finishing", "without its final checkpoint; the latest is 8) at step 20"),
                      ("stopped", "exit 0 before its last step) at step 12")):
        wd = tmp_path / how
        assert run_script(wd, EXIT_0, monkeypatch, how) == 1
        ev = rows(wd / "events.jsonl")
        assert [e["event"] for e in ev] == ["start", "gave_up"] and ev[-1]["kind"] == "incomplete"
        err = capsys.readouterr().err
        assert said in err and "not reporting it done" in err, err

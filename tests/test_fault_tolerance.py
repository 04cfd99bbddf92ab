"""Fault injection under the supervisor: kill -9 mid-step and mid-save, a crash followed by a restart on fewer
devices, an injected NaN, a loss spike and a hang; the supervised runs end where an uninterrupted run ends.

Marked slow (`./run.sh test -m slow`; real trainer processes, ~3 minutes on 2 cores). The default run checks their
parts at smaller scale: the same drills' supervisor side over a stand-in trainer (tests/test_fault_supervisor.py),
the trainer's side in-process (skipped data, spike, NaN exit and heartbeat: tests/test_train.py; a resume on fewer
devices from ZAYA_NUM_DEVICES: tests/test_parallel_train.py)."""

import json
import os
import sys

import jax
import numpy as np
import pytest

from tests.fault_configs.fault_tiny import get_config
from zaya_jax.fault.supervisor import Supervisor, SupervisorConfig
from zaya_jax.train.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "fault_configs", "fault_tiny.py")
pytestmark = pytest.mark.slow


def train_command(workdir, fault):
    return [sys.executable, "-m", "launch.train", f"--config={CONFIG}", f"--workdir={workdir}",
            f"--config.train.fault={fault}"]


def supervise(workdir, fault, **kw):
    cfg = SupervisorConfig(workdir=str(workdir), command=train_command(workdir, fault), backoff_s=0.1, poll_s=0.2, stop_grace_s=20.0,
                           spike_min_steps=3, spike_z=8.0, **kw)
    os.environ.setdefault("PYTHONPATH", ROOT)
    # the trainers it starts share the tests' compilation cache: restarts then skip most compilation
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return Supervisor(cfg).run()


def events(workdir):
    with open(os.path.join(workdir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_loss(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if r["step"] == 10 and "loss" in r][-1]


def test_kills_crash_and_fewer_devices_end_like_an_uninterrupted_run(tmp_path):
    clean = run(get_config(), str(tmp_path / "clean"), log=lambda *_: None)["loss"]
    wd = tmp_path / "faulty"
    devices = tmp_path / "devices"
    devices.write_text("8")
    # after the crash at step 7 only 4 devices are left: the restart must continue the same run on them
    fault = "kill@3,killsave@4,crash@7"
    cmd = f"[ -e {wd}/.fault_crash_7 ] && echo 4 > {devices}; cat {devices}"
    assert supervise(wd, fault, devices_cmd=cmd) == 0
    ev = events(wd)
    restarts = [e for e in ev if e["event"] == "restart"]
    assert [r["how"] for r in restarts] == ["signal 9", "signal 9", "exit 3"]
    assert [e.get("devices") for e in ev if e["event"] == "start"] == ["8", "8", "8", "4"]
    assert ev[-1]["event"] == "done"
    np.testing.assert_allclose(final_loss(wd), clean, rtol=1e-5)
    assert sorted(int(n) for n in os.listdir(wd / "checkpoints") if n.isdigit()) == [2, 4, 6, 8, 10]


def test_nan_spike_and_hang_are_rewound_skipped_and_restarted(tmp_path):
    wd = tmp_path / "run"
    assert supervise(wd, "hang@3,nan@5,spike@8", min_hang_s=5.0, startup_s=300.0) == 0
    ev = events(wd)
    rewinds = [e for e in ev if e["event"] == "rewind"]
    assert [(r["reason"], r["bad_step"], r["resume_from"], r["skip_steps"]) for r in rewinds] == [
        ("nonfinite", 5, 4, [5, 5]), ("spike", 8, 6, [8, 8])]
    hangs = [e for e in ev if e["event"] == "hang"]
    # detected at its hang timeout (max(min_hang_s, hang_factor x median step gap): longer on a loaded machine), not
    # at the 300 s start-up allowance
    assert [h["step"] for h in hangs] == [3] and 5.0 <= hangs[0]["timeout_s"] < 60.0
    assert hangs[0]["silent_s"] < hangs[0]["timeout_s"] + 5.0  # polled every 0.5 s; slack for a loaded CI machine
    assert ev[-1]["event"] == "done"
    with open(wd / "metrics.jsonl") as f:
        last = {}
        for line in f:
            r = json.loads(line)
            if "loss" in r:  # not the checkpoint rows
                last[r["step"]] = r["loss"]
    assert all(np.isfinite(v) and v < 20 for s, v in last.items() if s not in (5, 8))

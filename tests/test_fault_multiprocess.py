"""The supervisor over a group of processes (one jax.distributed job): 2 processes x 2 emulated CPU devices, one
of them killed with SIGKILL mid-run; the whole group restarts from the latest checkpoint and ends at the final loss
of an uninterrupted run on the same 4 devices."""

import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from tests.configs.fault_tiny import get_config
from zaya_jax.fault.drill import kill_rank_at, read_events, read_losses
from zaya_jax.fault.group import GroupError, GroupSpec, rank_env
from zaya_jax.train.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "configs", "fault_tiny.py")
STEPS = 10


def test_rank_environment():
    spec = GroupSpec(nproc=4, devices_per_process=2, platform="gpu")
    env = rank_env({"XLA_FLAGS": "--foo"}, 3, 4, spec, "127.0.0.1:1234")
    assert (env["ZAYA_PROCESS_ID"], env["ZAYA_NUM_PROCESSES"], env["JAX_COORDINATOR_ADDRESS"]) == (
        "3", "4", "127.0.0.1:1234")
    assert env["JAX_LOCAL_DEVICE_IDS"] == "6,7" and env["NCCL_NVLS_ENABLE"] == "0"
    cpu = rank_env({"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"}, 0, 2,
                   GroupSpec(nproc=2, devices_per_process=2, platform="cpu"), "127.0.0.1:1")
    assert cpu["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=2" and "JAX_LOCAL_DEVICE_IDS" not in cpu
    assert "ZAYA_NUM_PROCESSES" not in rank_env({}, 0, 1, spec, "x")  # one process: the plain trainer
    with pytest.raises(GroupError, match="must be >= 1"):
        GroupSpec(nproc=0)


def test_killed_rank_restarts_the_group_and_ends_like_an_uninterrupted_run(tmp_path):
    config = get_config()
    config.mesh.num_devices = 4  # the 2 x 2 devices of the group, in one process
    clean = run(config, str(tmp_path / "clean"), log=lambda *_: None)["loss"]

    wd = str(tmp_path / "group")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cmd = [sys.executable, "-m", "launch.supervise", "--nproc", "2", "--devices-per-process", "2", "--platform",
           "cpu", "--backoff", "0.1", "--peer-grace", "2", "--startup", "150", "--", sys.executable, "-m", "launch.train",
           f"--config={CONFIG}", f"--workdir={wd}", "--config.mesh.num_devices=0"]
    kill = {}
    killer = threading.Thread(target=lambda: kill.update(kill_rank_at(wd, rank=1, step=3, timeout_s=240)))
    killer.start()
    log = tmp_path / "supervise.log"
    with open(log, "w") as out:
        code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=400).returncode
    killer.join()
    assert code == 0, log.read_text()[-3000:]
    assert "error" not in kill, kill

    ev = read_events(wd)
    starts = [e for e in ev if e["event"] == "start"]
    assert [len(e["pids"]) for e in starts] == [2, 2] and starts[0]["pids"][1] == kill["killed_pid"]
    restarts = [e for e in ev if e["event"] == "restart"]
    assert [(r["how"], r["rank"]) for r in restarts] == [("signal 9", 1)]
    assert ev[-1]["event"] == "done" and ev[-1]["step"] == STEPS
    losses = read_losses(wd)
    assert sorted(losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(losses[STEPS], clean, rtol=1e-5)

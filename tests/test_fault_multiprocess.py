"""The supervisor over a group of processes (one jax.distributed job).

In the default run, with stand-in ranks (a few lines of Python, no jax): 2 ranks get their jax.distributed
variables and their emulated devices; one rank killed with SIGKILL while the other waits (as on a collective) stops
the group, which restarts whole.

Marked slow (`./run.sh test -m slow`), the real trainers: 2 processes x 2 emulated CPU devices, one of them killed
with SIGKILL mid-run; the whole group restarts from the latest checkpoint and ends at the losses of its own first
attempt at the first steps after the resume. And the uninterrupted 4-device run's mid-run checkpoint, resumed on 2
devices, continues with that run's losses. Runs through benchmarks/systems/scaling_runs.py, the code of
`benchmarks.scaling`'s restore and supervisor parts (launch.train, and launch.train under launch.supervise --nproc 2).
The default run checks their parts at smaller scale: 2 processes joining one jax.distributed job and reducing over
nodes and rails (tests/test_parallel_distributed.py), checkpoints resuming on fewer devices
(tests/test_parallel_train.py, tests/test_train.py), a killed stand-in trainer restarted by the supervisor from its
latest finished checkpoint (tests/test_fault_supervisor.py)."""

import json
import os
import sys

import jax
import pytest

from zaya_jax.fault.group import GroupError, GroupSpec, rank_env
from zaya_jax.fault.supervisor import Supervisor, SupervisorConfig
from benchmarks.systems.scaling_runs import (
    RunPlan,
    reference,
    restore_on_fewer,
    supervised_kill,
)

PLAN = RunPlan(steps=6, checkpoint_every=2, rows=8, seq_len=32, kill_at=3)


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


# A stand-in rank: logs its environment; on the group's first start rank 1 dies by SIGKILL and rank 0 waits as if
# blocked on a collective with it (only the supervisor's stop can end it); on the second start both finish.
RANK = """
import json, os, signal, sys, time
workdir = sys.argv[1]
rank = os.environ["ZAYA_PROCESS_ID"]
keys = ("ZAYA_PROCESS_ID", "ZAYA_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS", "XLA_FLAGS")
with open(os.path.join(workdir, "ranks.jsonl"), "a") as f:
    f.write(json.dumps({**{k: os.environ.get(k) for k in keys}, "pid": os.getpid()}) + "\\n")
marker = os.path.join(workdir, "started_" + rank)
if not os.path.exists(marker):
    open(marker, "w").close()
    if rank == "1":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
"""


def test_a_dead_rank_stops_and_restarts_the_whole_group(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cfg = SupervisorConfig(workdir=str(tmp_path), command=[sys.executable, str(script), str(tmp_path)], backoff_s=0.1,
                           poll_s=0.1, peer_grace_s=5.0, group=GroupSpec(nproc=2, devices_per_process=2,
                                                                         platform="cpu"))
    assert Supervisor(cfg).run() == 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("how"), e.get("rank")) for e in events] == [
        ("start", None, None), ("restart", "signal 9", 1), ("start", None, None), ("done", None, None)]
    ranks = [json.loads(line) for line in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert len(ranks) == 4 and {r["pid"] for r in ranks} == set(events[0]["pids"] + events[2]["pids"])
    for start in (events[0], events[2]):
        group = sorted((r for r in ranks if r["pid"] in start["pids"]), key=lambda r: r["ZAYA_PROCESS_ID"])
        assert [(r["ZAYA_PROCESS_ID"], r["ZAYA_NUM_PROCESSES"]) for r in group] == [("0", "2"), ("1", "2")]
        assert group[0]["JAX_COORDINATOR_ADDRESS"] == group[1]["JAX_COORDINATOR_ADDRESS"]
        assert all(r["XLA_FLAGS"].split()[-1] == "--xla_force_host_platform_device_count=2" for r in group)
    for pid in events[0]["pids"]:  # rank 0 of the first start was stopped, not left waiting
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_killed_rank_restarts_the_group_and_a_checkpoint_resumes_on_fewer_devices(tmp_path, monkeypatch):
    # the trainers share the tests' compilation cache (and conftest's XLA_FLAGS: no LLVM optimisation)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    ref_dir = str(tmp_path / "reference")
    ref = reference(ref_dir, PLAN, devices=4, timeout=300)
    assert ref["exit"] == 0, ref.get("error")
    fewer = restore_on_fewer(ref_dir, str(tmp_path / "on2"), PLAN, devices=4, fewer=2, timeout=300)
    assert fewer["exit"] == 0, fewer.get("error")
    assert fewer["resumed_from_step"] == 2 and fewer["resume_matches"], fewer
    assert fewer["first_steps_after_resume"]["steps"] == [3, 4, 5] and fewer["missing_steps"] == []
    assert [d["steps"] for d in fewer["drift_vs_reference"]] == [[1, 10]]

    out = supervised_kill(ref_dir, str(tmp_path / "group"), PLAN, nproc=2, timeout=300, platform="cpu",
                          devices_per_process=2)
    assert out["exit"] == 0, out.get("error")
    assert out["kill"]["rank"] == 1 and out["kill"]["at_step"] >= PLAN.kill_at, out["kill"]
    events = [(e["event"], e.get("how"), e.get("rank")) for e in out["timeline"]]
    assert events == [("start", None, None), ("restart", "signal 9", 1), ("start", None, None), ("done", None, None)]
    starts = [e for e in out["timeline"] if e["event"] == "start"]
    assert len(starts[0]["pids"]) == 2 and starts[0]["pids"][1] == out["kill"]["killed_pid"]
    assert out["attempts"] == 2 and out["finished"] and out["resumed_from_step"] >= 2, out  # a checkpoint, not step 0
    assert out["checkpoints_left"]["other"] == [], out["checkpoints_left"]  # no unfinished save left behind
    assert out["resumed_and_matched"], out

"""Whole training runs for the scaling report, through the real CLIs (launch.train, launch.supervise):

  restore     train on N devices with checkpoints; resume a copy of the run from a mid-run checkpoint on fewer
              devices (the supervisor's ZAYA_NUM_DEVICES path); the resumed losses must equal the uninterrupted run's
  supervisor  N processes (one per device) under `launch.supervise --nproc N`; rank N-1 is killed with SIGKILL
              mid-run; the group restarts from the last checkpoint and must end at the uninterrupted final loss
Both train the same small fp32 model on the built-in corpus (default config); the uninterrupted N-device run is
the reference of both. fp32 matmuls at full precision, so only reduction order separates the runs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time

from zaya_jax.fault.drill import kill_rank_at, read_losses, timeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class RunPlan:
    steps: int = 100
    checkpoint_every: int = 20
    rows: int = 16  # sequences per step (must split over every device count used)
    seq_len: int = 128
    kill_at: int = 45  # heartbeat step at which the supervisor drill kills a rank
    rtol: float = 1e-4

    def overrides(self) -> list[str]:
        s = self
        return [f"--config.train.steps={s.steps}", f"--config.optim.total_steps={s.steps}",
                f"--config.optim.warmup_steps={max(1, min(5, s.steps // 4))}", f"--config.data.seq_len={s.seq_len}", "--config.data.prefetch=0",
                f"--config.train.global_batch_tokens={s.rows * s.seq_len}",
                f"--config.train.microbatch_tokens={s.rows * s.seq_len}", "--config.train.log_every=1",
                "--config.train.eval_every=0", f"--config.train.checkpoint_every={s.checkpoint_every}",
                f"--config.train.keep_checkpoints={s.steps // s.checkpoint_every + 1}"]


def train_command(workdir: str, plan: RunPlan, devices: int) -> list[str]:
    return [sys.executable, "-m", "launch.train", f"--config={os.path.join(ROOT, 'configs', 'default.py')}",
            f"--workdir={workdir}", f"--config.mesh.num_devices={devices}", *plan.overrides()]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return {**env, **(extra or {})}


def _train(cmd, log_path: str, timeout: float, env: dict) -> tuple[int, float]:
    t = time.perf_counter()
    with open(log_path, "w") as out:
        try:
            code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return code, time.perf_counter() - t


def _tail(path: str, chars: int = 1500) -> str:
    with open(path) as f:
        return f.read()[-chars:]


def _compare(got: dict, want: dict, steps) -> dict:
    diffs = [abs(got[s] - want[s]) / abs(want[s]) for s in steps if s in got and s in want]
    missing = [s for s in steps if s not in got]
    return {"steps_compared": len(diffs), "missing_steps": missing[:10],
            "max_rel_diff": max(diffs) if diffs else None}


def reference(workdir: str, plan: RunPlan, devices: int, timeout: float) -> dict:
    code, wall = _train(train_command(workdir, plan, devices), f"{workdir}.log", timeout, _env())
    out = {"devices": devices, "exit": code, "wall_s": wall}
    if code != 0:
        out["error"] = _tail(f"{workdir}.log")
    return out


def restore_on_fewer(ref_dir: str, workdir: str, plan: RunPlan, devices: int, fewer: int, timeout: float) -> dict:
    """Copies the reference run, keeps checkpoints up to the middle, resumes on `fewer` devices."""
    resume_at = plan.steps // 2 // plan.checkpoint_every * plan.checkpoint_every
    shutil.copytree(ref_dir, workdir)
    ckpts = os.path.join(workdir, "checkpoints")
    for name in os.listdir(ckpts):
        if name.isdigit() and int(name) > resume_at:
            shutil.rmtree(os.path.join(ckpts, name))
    os.remove(os.path.join(workdir, "metrics.jsonl"))
    code, wall = _train(train_command(workdir, plan, devices), f"{workdir}.log", timeout,
                        _env({"ZAYA_NUM_DEVICES": str(fewer)}))
    out = {"saved_on_devices": devices, "restored_on_devices": fewer, "resumed_from_step": resume_at,
           "exit": code, "wall_s": wall}
    if code != 0:
        out["error"] = _tail(f"{workdir}.log")
        return out
    cmp = _compare(read_losses(workdir), read_losses(ref_dir), range(resume_at + 1, plan.steps + 1))
    out.update(cmp, rtol=plan.rtol, losses_match=cmp["max_rel_diff"] is not None and not cmp["missing_steps"]
               and cmp["max_rel_diff"] <= plan.rtol)
    return out


def supervised_kill(ref_dir: str, workdir: str, plan: RunPlan, nproc: int, timeout: float,
                    platform: str = "auto", devices_per_process: int = 1) -> dict:
    """N processes under the supervisor; rank nproc-1 killed with SIGKILL at step >= plan.kill_at."""
    cmd = [sys.executable, "-m", "launch.supervise", "--nproc", str(nproc), "--devices-per-process",
           str(devices_per_process), "--platform", platform, "--backoff", "0.5", "--startup", str(int(min(timeout, 300))),
           "--", *train_command(workdir, plan, 0)]
    kill: dict = {}
    t0 = time.time()
    killer = threading.Thread(target=lambda: kill.update(kill_rank_at(workdir, nproc - 1, plan.kill_at, timeout)),
                              daemon=True)
    killer.start()
    code, wall = _train(cmd, f"{workdir}.log", timeout, _env())
    killer.join(timeout=5)
    out = {"nproc": nproc, "exit": code, "wall_s": wall, "kill": kill, "timeline": timeline(workdir, t0)}
    if code != 0:
        out["error"] = _tail(f"{workdir}.log")
        return out
    got, want = read_losses(workdir), read_losses(ref_dir)
    restarts = [e for e in out["timeline"] if e["event"] == "restart"]
    out["restarts"] = len(restarts)
    if "time" in kill:
        out["kill"]["t_s"] = round(kill["time"] - t0, 2)
        resumed = next((e for e in out["timeline"] if e["event"] == "start" and e["t_s"] > out["kill"]["t_s"]), None)
        out["recovery_s"] = None if resumed is None else round(resumed["t_s"] - out["kill"]["t_s"], 2)
    cmp = _compare(got, want, range(1, plan.steps + 1))
    final = plan.steps
    out.update(cmp, final_loss=got.get(final), reference_final_loss=want.get(final), rtol=plan.rtol,
               resumed_and_matched=bool(restarts) and cmp["max_rel_diff"] is not None and not cmp["missing_steps"]
               and cmp["max_rel_diff"] <= plan.rtol)
    return out

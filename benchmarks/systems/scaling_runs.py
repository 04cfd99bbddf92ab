"""Whole training runs for the scaling report, through the real CLIs (launch.train, launch.supervise):

  restore     train on N devices with checkpoints; resume a copy of the run from a mid-run checkpoint on fewer
              devices (the supervisor's ZAYA_NUM_DEVICES path)
  supervisor  N processes (one per device) under `launch.supervise --nproc N`; rank N-1 is killed with SIGKILL
              mid-run; the group restarts from its last finished checkpoint and trains to the end
Both train the same small fp32 model on the built-in corpus (default config); the uninterrupted N-device run in
one process is the reference. fp32 matmuls at full precision and, on GPU, XLA's deterministic ops, so only the
reduction order separates runs on different layouts; MoE routing turns that rounding into chaotic drift after a
few dozen steps. So the verdicts are: the first `tight_steps` steps after a resume equal the uninterrupted run's
within `tight_rtol` (the resumed state is the saved one), and later steps are reported as a drift curve (the largest
relative loss difference in each block of 10 steps), not judged. The supervisor's same-layout uninterrupted run
is its own first attempt: the steps between the checkpoint it resumes from and the kill ran there already.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time

from zaya_jax.fault.drill import kill_rank_at, read_attempts, read_losses, timeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class RunPlan:
    steps: int = 100
    checkpoint_every: int = 20
    rows: int = 16  # sequences per step (must split over every device count used)
    seq_len: int = 128
    kill_at: int = 45  # heartbeat step at which the supervisor drill kills a rank
    tight_steps: int = 3  # steps after a resume that must equal the uninterrupted run's
    tight_rtol: float = 1e-5
    drift_block: int = 10  # steps per point of the drift curve

    def overrides(self) -> list[str]:
        """The drills' config. The bias controller is off: each data-parallel rank balances its own share of a
        microbatch (docs/routing.md), so with it on, a run resumed on fewer devices routes differently by design."""
        s = self
        return ["--config.balancing.learning_rate=0.0", f"--config.train.steps={s.steps}",
                f"--config.optim.total_steps={s.steps}",
                f"--config.optim.warmup_steps={max(1, min(5, s.steps // 4))}", f"--config.data.seq_len={s.seq_len}", "--config.data.prefetch=0",
                f"--config.train.global_batch_tokens={s.rows * s.seq_len}",
                f"--config.train.microbatch_tokens={s.rows * s.seq_len}", "--config.train.log_every=1",
                "--config.train.eval_every=0", f"--config.train.checkpoint_every={s.checkpoint_every}",
                f"--config.train.keep_checkpoints={s.steps // s.checkpoint_every + 1}"]


def train_command(workdir: str, plan: RunPlan, devices: int) -> list[str]:
    return [sys.executable, "-m", "launch.train", f"--config={os.path.join(ROOT, 'configs', 'default.py')}",
            f"--workdir={workdir}", f"--config.mesh.num_devices={devices}", *plan.overrides()]


DETERMINISTIC_GPU = "--xla_gpu_deterministic_ops=true"  # no atomics in scatter-adds / reductions: reruns repeat


def _env(extra: dict | None = None, *, gpu: bool = False) -> dict:
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest", PYTHONUNBUFFERED="1")
    if gpu:
        flags = env.get("XLA_FLAGS", "").split()
        env["XLA_FLAGS"] = " ".join(flags + ([DETERMINISTIC_GPU] if DETERMINISTIC_GPU not in flags else []))
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


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def drift_curve(got: dict, want: dict, steps, block: int) -> list[dict]:
    """Largest relative loss difference in each block of `block` steps (steps present in both runs)."""
    out: dict[int, dict] = {}
    for s in steps:
        if s in got and s in want:
            first = (s - 1) // block * block + 1
            row = out.setdefault(first, {"steps": [first, first + block - 1], "max_rel_diff": 0.0})
            row["max_rel_diff"] = max(row["max_rel_diff"], _rel(got[s], want[s]))
    return list(out.values())


def tight_check(got: dict, want: dict, steps, rtol: float) -> dict:
    """Each of `steps` present in both runs and equal within rtol."""
    steps = list(steps)
    diffs = {s: _rel(got[s], want[s]) for s in steps if s in got and s in want}
    missing = [s for s in steps if s not in diffs]
    worst = max(diffs.values()) if diffs else None
    return {"steps": steps, "rel_diffs": [diffs.get(s) for s in steps], "missing": missing, "rtol": rtol,
            "match": bool(diffs) and not missing and worst <= rtol}


def checkpoint_dirs(workdir: str) -> dict:
    """Finished checkpoint steps and anything else left in the checkpoint folder (unfinished Orbax tmp saves)."""
    try:
        names = os.listdir(os.path.join(workdir, "checkpoints"))
    except FileNotFoundError:
        return {"steps": [], "other": []}
    return {"steps": sorted(int(n) for n in names if n.isdigit()), "other": sorted(n for n in names if not n.isdigit())}


def reference(workdir: str, plan: RunPlan, devices: int, timeout: float, *, gpu: bool = False) -> dict:
    code, wall = _train(train_command(workdir, plan, devices), f"{workdir}.log", timeout, _env(gpu=gpu))
    out = {"devices": devices, "processes": 1, "exit": code, "wall_s": wall}
    if code != 0:
        out["error"] = _tail(f"{workdir}.log")
    return out


def restore_on_fewer(ref_dir: str, workdir: str, plan: RunPlan, devices: int, fewer: int, timeout: float, *,
                     gpu: bool = False) -> dict:
    """Copies the reference run, keeps checkpoints up to the middle, resumes on `fewer` devices."""
    resume_at = plan.steps // 2 // plan.checkpoint_every * plan.checkpoint_every
    shutil.copytree(ref_dir, workdir)
    ckpts = os.path.join(workdir, "checkpoints")
    for name in os.listdir(ckpts):
        if name.isdigit() and int(name) > resume_at:
            shutil.rmtree(os.path.join(ckpts, name))
    for name in ("metrics.jsonl", "metrics.attempts.jsonl"):  # the copy logs only what the resumed run trains
        if os.path.exists(os.path.join(workdir, name)):
            os.remove(os.path.join(workdir, name))
    code, wall = _train(train_command(workdir, plan, devices), f"{workdir}.log", timeout,
                        _env({"ZAYA_NUM_DEVICES": str(fewer)}, gpu=gpu))
    out = {"saved_on_devices": devices, "restored_on_devices": fewer, "resumed_from_step": resume_at,
           "exit": code, "wall_s": wall}
    if code != 0:
        out["error"] = _tail(f"{workdir}.log")
        return out
    got, want = read_losses(workdir), read_losses(ref_dir)
    after = range(resume_at + 1, plan.steps + 1)
    out["first_steps_after_resume"] = tight_check(got, want, after[:plan.tight_steps], plan.tight_rtol)
    out["drift_vs_reference"] = drift_curve(got, want, after, plan.drift_block)
    out["finished"] = plan.steps in got
    out["missing_steps"] = [s for s in after if s not in got][:10]
    out["resume_matches"] = out["first_steps_after_resume"]["match"] and out["finished"] and not out["missing_steps"]
    return out


def supervised_kill(ref_dir: str, workdir: str, plan: RunPlan, nproc: int, timeout: float,
                    platform: str = "auto", devices_per_process: int = 1) -> dict:
    """N processes under the supervisor; rank nproc-1 killed with SIGKILL at step >= plan.kill_at.

    The verdict: the group restarted, resumed from a finished checkpoint at or before the kill, trained to the end,
    and its first steps after the resume equal the same steps of its own first attempt (same process layout,
    uninterrupted up to the kill). The 1-process reference gives the layout noise band (not judged)."""
    cmd = [sys.executable, "-m", "launch.supervise", "--nproc", str(nproc), "--devices-per-process",
           str(devices_per_process), "--platform", platform, "--backoff", "0.5", "--startup", str(int(min(timeout, 300))),
           "--", *train_command(workdir, plan, 0)]
    kill: dict = {}
    t0 = time.time()
    killer = threading.Thread(target=lambda: kill.update(kill_rank_at(workdir, nproc - 1, plan.kill_at, timeout)),
                              daemon=True)
    killer.start()
    code, wall = _train(cmd, f"{workdir}.log", timeout, _env(gpu=platform == "gpu"))
    killer.join(timeout=5)
    # the supervisor's 'from_step' is the last heartbeat it saw, not the checkpoint the restart resumes from
    out = {"nproc": nproc, "exit": code, "wall_s": wall, "kill": kill, "timeline": timeline(workdir, t0)}
    if code != 0:
        out["error"] = _tail(f"{workdir}.log")
        return out
    restarts = [e for e in out["timeline"] if e["event"] == "restart"]
    out["restarts"] = len(restarts)
    if "time" in kill:
        out["kill"]["t_s"] = round(kill["time"] - t0, 2)
        resumed = next((e for e in out["timeline"] if e["event"] == "start" and e["t_s"] > out["kill"]["t_s"]), None)
        out["recovery_s"] = None if resumed is None else round(resumed["t_s"] - out["kill"]["t_s"], 2)
    out.update(supervised_verdict(workdir, ref_dir, plan, kill.get("at_step")))
    return out


def supervised_verdict(workdir: str, ref_dir: str, plan: RunPlan, killed_at: int | None) -> dict:
    attempts, want = read_attempts(workdir), read_losses(ref_dir)
    out = {"attempts": len(attempts), "checkpoints_left": checkpoint_dirs(workdir)}
    if len(attempts) < 2:
        out["resumed_and_matched"] = False
        out["why_not"] = f"{len(attempts)} start(s) logged steps: no resume to check"
        return out
    first, last = attempts[0], attempts[-1]
    resumed_from = min(last) - 1
    finished = {}
    for a in attempts:
        finished.update(a)
    # a finished checkpoint (not a restart from scratch): on the save cadence, at or before the first attempt's
    # last logged step; an unfinished (killed) save stays an Orbax tmp folder and is never resumed from
    ckpt_ok = 0 < resumed_from <= max(first) and resumed_from % plan.checkpoint_every == 0
    overlap = [s for s in range(resumed_from + 1, max(first) + 1)][:plan.tight_steps]
    out.update({
        "resumed_from_step": resumed_from,
        "killed_at_step": killed_at,
        "steps_lost": max(first) - resumed_from,
        "resumed_from_a_cadence_checkpoint": ckpt_ok,
        "finished": plan.steps in last and all(s in finished for s in range(1, plan.steps + 1)),
        "first_steps_after_resume_vs_first_attempt": tight_check(last, first, overlap, plan.tight_rtol),
        "layout_noise_before_kill": drift_curve(first, want, range(1, max(first) + 1), plan.drift_block),
        "drift_vs_reference": drift_curve(finished, want, range(1, plan.steps + 1), plan.drift_block),
        "final_loss": last.get(plan.steps), "reference_final_loss": want.get(plan.steps),
    })
    if len(overlap) < plan.tight_steps:
        out["note"] = (f"only {len(overlap)} step(s) between the resume point and the kill ran in the first attempt; "
                       f"the tight check covers those")
    out["resumed_and_matched"] = bool(ckpt_ok and out["finished"] and overlap
                                      and out["first_steps_after_resume_vs_first_attempt"]["match"])
    return out

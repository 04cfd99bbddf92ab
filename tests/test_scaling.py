"""`python -m benchmarks.scaling --cpu-smoke`: the multi-GPU scaling report's code on 2 emulated CPU devices with tiny
shapes (DP weak scaling, CP equality; the collectives sweep is tested in tests/test_systems_collectives.py, the
restore and supervisor parts' code in tests/test_fault_multiprocess.py). Checks what each part reports, not how
fast the CPU is.

The report run is marked slow (an orchestrator and one process per part, ~2 minutes on 2 cores; `./run.sh test -m
slow`): the default run checks its parts at smaller scale, context-parallel logits and gradients equal to one
device's (tests/test_parallel_context.py) and the trainer on 1 and several devices training alike
(tests/test_parallel_train.py), and the supervisor verdict below."""

import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_cpu_smoke_report(tmp_path):
    out = tmp_path / "scaling.json"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    done = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--cpu-smoke", "--devices", "2", "--out", str(out),
                           "--parts", "dp,cp", "--workdir", str(tmp_path / "work")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert r["parts"]["cp"]["model"]["attention_impl"] == "xla" and r["parts"]["dp"]["model"]["attention_impl"] == "xla"
    assert r["nccl_reference"]["source"].startswith("https://github.com/NVIDIA/nccl-tests/issues/212")
    dp = r["parts"]["dp"]
    assert [x["devices"] for x in dp["runs"]] == [1, 2] and dp["dp_weak_scaling_efficiency_2"] > 0
    cp = r["parts"]["cp"]["runs"]
    assert [(x["seq_len"], x["cp"]) for x in cp] == [(64, 1), (64, 2)] and cp[1]["equal"], cp[1]
    assert r["headline"]["cp_all_equal"] and r["headline"]["dp_weak_scaling_efficiency_2"] > 0
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_cudnn_attention_is_refused_on_several_devices():
    from zaya_jax.config import preset
    from benchmarks.systems.scaling_step import MeshStep, StepSpec
    cfg = preset("tiny", num_hidden_layers=1, attention_impl="cudnn")
    with pytest.raises(ValueError, match="cudnn.*runs on one device only"):
        MeshStep(StepSpec(cfg, 32, 2, 2))


def _write_metrics(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "loss": loss}) + "\n" for s, loss in rows)


def test_supervisor_verdict_uses_the_first_attempt_and_the_resume_checkpoint(tmp_path):
    from benchmarks.systems.scaling_runs import RunPlan, read_attempts, supervised_verdict
    plan = RunPlan(steps=8, checkpoint_every=2, kill_at=5, tight_steps=2)
    ref = [(s, 3.0 - 0.1 * s) for s in range(1, 9)]
    _write_metrics(tmp_path / "ref", ref)
    noisy = [(s, v * (1 + 1e-4)) for s, v in ref]  # another process layout: off the reference by 1e-4 everywhere
    # killed after step 5; the step-4 save was unfinished, so the restart resumed from step 2 and redid 3..5
    _write_metrics(tmp_path / "group", noisy[:5] + noisy[2:])
    assert [sorted(a) for a in read_attempts(str(tmp_path / "group"))] == [[1, 2, 3, 4, 5], list(range(3, 9))]
    v = supervised_verdict(str(tmp_path / "group"), str(tmp_path / "ref"), plan, killed_at=5)
    assert (v["resumed_from_step"], v["steps_lost"], v["finished"]) == (2, 3, True)
    assert v["first_steps_after_resume_vs_first_attempt"]["steps"] == [3, 4] and v["resumed_and_matched"], v
    assert v["layout_noise_before_kill"][0]["max_rel_diff"] == pytest.approx(1e-4)
    # a restart that repeats different losses, or that started over from step 0, is not a match
    _write_metrics(tmp_path / "off", noisy[:5] + [(s, v * 1.01) for s, v in noisy[2:]])
    assert not supervised_verdict(str(tmp_path / "off"), str(tmp_path / "ref"), plan, 5)["resumed_and_matched"]
    _write_metrics(tmp_path / "scratch", noisy[:5] + noisy)
    v = supervised_verdict(str(tmp_path / "scratch"), str(tmp_path / "ref"), plan, 5)
    assert v["resumed_from_step"] == 0 and not v["resumed_from_a_cadence_checkpoint"] and not v["resumed_and_matched"]

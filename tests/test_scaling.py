"""`python -m launch.scaling --cpu-smoke`: the multi-GPU scaling report's code on 2 emulated CPU devices with tiny
shapes (collectives, DP weak scaling, CP equality; the restore and supervisor parts' code runs in
tests/test_fault_multiprocess.py). Checks what each part reports, not how fast the CPU is."""

import json
import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_smoke_report(tmp_path):
    out = tmp_path / "scaling.json"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    done = subprocess.run([sys.executable, "-m", "launch.scaling", "--cpu-smoke", "--devices", "2", "--out", str(out),
                           "--parts", "collectives,dp,cp", "--workdir", str(tmp_path / "work")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert r["nccl_reference"]["source"].startswith("https://github.com/NVIDIA/nccl-tests/issues/212")
    coll = r["parts"]["collectives"]
    assert {(s["n"], s["collective"]) for s in coll["summary"]} == {
        (2, c) for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}
    assert all(c["max_abs_error"] == 0 for c in coll["checks"])
    dp = r["parts"]["dp"]
    assert [x["devices"] for x in dp["runs"]] == [1, 2] and dp["dp_weak_scaling_efficiency_2"] > 0
    cp = r["parts"]["cp"]["runs"]
    assert [(x["seq_len"], x["cp"]) for x in cp] == [(64, 1), (64, 2)] and cp[1]["equal"], cp[1]
    assert r["headline"]["cp_all_equal"] and r["headline"]["dp_weak_scaling_efficiency_2"] > 0
    assert (tmp_path / "scaling.png").stat().st_size > 10_000

"""The inference benchmark's bookkeeping on the CPU (benchmarks/inference_phases.py, benchmarks/bench_inference.py):
a failing phase is recorded and the next one runs, phases are skipped near the deadline, the JSON is re-written
after each phase, --phases selects measurements, timing respects its deadline, the ratios and greedy comparison
tolerate missing halves, and the chunked on-device init keeps the model's shapes and dtypes."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import bench_inference
from benchmarks.inference_phases import FAIL_ENV, Phases, decode_rate, timed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_phases_record_errors_skips_and_write_after_each(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "bad")
    out = tmp_path / "p.json"
    phases = Phases(str(out), deadline=1e18, prefix="t")
    seen = []

    def good():
        seen.append(json.load(open(out))["phases"]["good"]["status"])  # written before the phase runs
        return {"x": 1}

    assert phases.run("good", good)
    assert not phases.run("bad", lambda: {"y": 2})
    assert not phases.run("raises", lambda: 1 / 0)
    phases.deadline = 0.0
    assert not phases.run("late", lambda: {"z": 3}, min_left_s=10)
    assert phases.run("required", lambda: {"w": 4}, min_left_s=-float("inf"))
    data = json.load(open(out))
    assert seen == ["running"]
    assert data["good"] == {"x": 1} and data["required"] == {"w": 4}
    status = {k: v["status"] for k, v in data["phases"].items()}
    assert status == {"good": "ok", "bad": "error", "raises": "error", "late": "skipped", "required": "ok"}
    assert "ZeroDivisionError" in data["phases"]["raises"]["error"] and "late" not in data


def test_phases_run_only_the_selected_measurements_and_every_setup(tmp_path):
    phases = Phases(str(tmp_path / "p.json"), deadline=1e18, prefix="t", only=["decode_compiled_*", "compile"])
    assert phases.run("load", lambda: {}, min_left_s=-float("inf"))
    assert phases.run("compile", lambda: {}) and phases.run("decode_compiled_64", lambda: {})
    assert not phases.run("decode_eager_64", lambda: {}) and not phases.run("scoring_compiled_8x4096", lambda: {})
    assert phases.data["phases"]["decode_eager_64"] == {"status": "skipped", "reason": "not selected (--phases)"}
    # the warm-ups compile (and, for decode, run on the device) only the selected phases' programs
    phases.compile_record = {}
    spec = {"scoring": [(2, 64)], "decode_batches": [1], "compile_threads": 1}
    assert bench_inference.start_compiles(spec, {}, None, phases) == {} and phases.compile_record == {}


def test_timed_stops_at_the_deadline():
    calls = []
    t = timed(lambda: calls.append(1), lambda v: None, repeats=5, deadline=0.0)
    assert t["n"] == 0 and len(calls) == 1 and abs(t["median_s"] - t["first_s"]) < 1e-3
    t = timed(lambda: 3, lambda v: None, repeats=3, deadline=1e18)
    assert t["n"] == 3 and t["value"] == 3
    t = timed(lambda: 3, lambda v: None, repeats=3, deadline=1e18, warmed=True)
    assert t["n"] == 3 and len(t["times"]) == 3
    assert decode_rate(10, 1.0, 2.0) is None and decode_rate(10, 2.0, 1.0) == 10


def test_ratios_and_greedy_equality_with_partial_results(tmp_path):
    ours = {"scoring_2x64": {"tokens_per_s": 200.0, "logp": [-1.0, -2.0]},
            "decode_1": {"decode_tokens_per_s": 50.0, "roofline_tokens_per_s": 100.0, "ttft_s": 0.5},
            "decode_2": {"decode_tokens_per_s": None}, "phases": {}}
    hf = {"scoring_eager_2x64": {"tokens_per_s": 100.0, "logp": [-1.5, -2.0]},
          "decode_eager_1": {"decode_tokens_per_s": 25.0, "ttft_s": 1.0}}
    r = bench_inference.ratios(ours, hf)
    assert r["scoring_2x64_vs_hf_best"] == 2.0 and r["decode_1_vs_hf_eager"] == 2.0
    assert r["decode_1_of_roofline"] == 0.5 and r["ttft_1_hf_eager_over_ours"] == 2.0
    assert not any(k.startswith("decode_2") for k in r)
    assert bench_inference.ratios({}, {}) == {}
    assert bench_inference.scoring_agreement(ours, hf)["2x64_vs_hf_eager"]["max_abs_diff"] == 0.5
    spec = {"work": str(tmp_path), "decode_batches": [1, 2]}
    np.save(tmp_path / "tokens_ours_b1.npy", np.array([[5, 6, 7, 8]], np.int32))
    np.save(tmp_path / "tokens_hf_eager_b1.npy", np.array([[5, 6, 9, 8]], np.int32))
    np.save(tmp_path / "tokens_ours_b2.npy", np.zeros((2, 4), np.int32))
    g = bench_inference.greedy_equality(spec)
    assert list(g) == ["1"] and g["1"]["min_equal_prefix"] == 2 and g["1"]["tokens_equal_fraction"] == 0.75


def test_chunked_init_matches_the_model_shapes():
    from zaya_jax.config import preset
    from zaya_jax.model import ZayaForCausalLM
    model = bench_inference.init_model("tiny", chunk_elements=1 << 10)
    cfg = preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
    want = nnx.state(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    got = nnx.state(model)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
    experts = np.asarray(model.model.layers.mlp.experts.gate_up_proj[...], np.float32)
    assert abs(experts.std() - cfg.initializer_range) < 2e-3 and len(np.unique(experts[0, 0])) > 100
    assert not np.array_equal(experts[0], experts[1])  # layers (and chunks) draw different numbers


@pytest.mark.slow
def test_every_jax_phase_runs_at_tiny_shapes(tmp_path):
    """The benchmark's JAX half end to end on the CPU (--quick): every phase and warm-up compile succeeds, so that a
    change of the library's inference API cannot leave a GPU run's phases failing (the decode phases once did, after
    the generation loop's signature changed). The HF half runs under this python, which has no torch: it fails alone."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_inference", "--preset", "tiny", "--quick",
                           "--time-budget", "300", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(out.read_text())["ours"]
    assert {name: phase["status"] for name, phase in ours["phases"].items()} == dict.fromkeys(
        ["init", "export", "copy_bandwidth", "scoring_2x64", "decode_1", "decode_2"], "ok")
    assert {name: record["status"] for name, record in ours["compile"].items()} == dict.fromkeys(
        ["scoring_2x64", "decode_1", "decode_2"], "ok")
    assert all("error" not in record["xla_memory_gib"] for record in ours["compile"].values())

"""The inference profilers attribute kernel time to model source lines: benchmarks.profile_scoring on the tiny
preset (CPU, its own process: XLA reads the dump flag at backend start) puts most of a call's kernel time on
zaya_jax lines, the vocabulary head's among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a benchmark tool's real run (CI's slow pass)
def test_profile_scoring_attributes_kernels_to_source_lines(tmp_path):
    out = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.profile_scoring", "--preset", "tiny", "--batch", "2",
                           "--length", "32", "--continuation", "4", "--kernels", "xla", "--top", "1000",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sources = {row["source"]: row["calls_per_call"] for row in report["top_sources"]}
    # counted in kernels, not time: on a loaded CPU the frame-less parameter relayouts' share of the time varies
    attributed = sum(n for source, n in sources.items() if source.startswith("zaya_jax/"))
    assert attributed > 0.5 * report["kernels_per_call"], sources
    assert any("scoring.py" in source for source in sources), sources  # the head and log-softmax of the window
    assert report["source_lookup"]["unnamed"] == [], report["source_lookup"]  # every kernel found in a module


def test_kernels_named_as_a_gpu_names_them_find_their_source_lines(tmp_path, monkeypatch):
    """A GPU kernel (or a command buffer's replay of it) carries its instruction's name with '.' made '_', and its
    program id need not be a dumped module's: both still find the instruction's source line."""
    import jax
    import jax.numpy as jnp

    from benchmarks import profile_decode
    from benchmarks.systems import profile_trace
    from benchmarks.training.bench_profile import hlo_sources
    from zaya_jax.ops.rmsnorm import rms_norm_reference

    text = jax.jit(lambda x, w: rms_norm_reference(x, w, 1e-6)).lower(jnp.ones((4, 8)), jnp.ones(8)).compile().as_text()
    named = [name for name, source in hlo_sources(text).items() if "rmsnorm.py" in source]
    assert named, text
    dotted = named[0] + ".12"  # XLA numbers repeated instruction names: "fusion.12"; its kernel is "fusion_12"
    (tmp_path / "module_0007.jit_norm.after_optimizations.txt").write_text(text.replace(f"%{named[0]} ", f"%{dotted} "))
    names = profile_decode.module_sources(str(tmp_path))[7]
    events = [profile_trace.OpEvent("/device:GPU:0", "Stream #1", profile_decode.kernel_name(dotted),
                                    "command_buffer.3", "jit_norm", 0.0, 2e3, program_id=99),
              profile_trace.OpEvent("/device:GPU:0", "Stream #1", "nvjet_gemm", None, "jit_norm", 5e3, 1e3,
                                    program_id=7)]
    monkeypatch.setattr(profile_trace, "load", lambda logdir: (events, [], ["Stream #1"]))
    tables = profile_decode.kernel_tables(lambda: None, str(tmp_path), 1, "call", 10)
    sources = {row["source"]: row["ms_per_call"] for row in tables["top_sources"]}
    assert sources[names[profile_decode.kernel_name(dotted)]] == 0.002 and sources["(no project frame)"] == 0.001
    assert tables["source_lookup"]["unnamed"] == ["nvjet_gemm"]


def test_idle_time_counts_the_gaps_between_kernels_once():
    """Overlapping kernels (two streams) leave no gap; the gaps and the span per unit, the largest first."""
    from benchmarks import profile_decode
    from benchmarks.systems import profile_trace

    def op(name, start_us, dur_us, line="Stream #1"):
        return profile_trace.OpEvent("/device:GPU:0", line, name, None, "m", start_us * 1e3, dur_us * 1e3)

    ops = [op("a", 0, 10), op("b", 5, 10, "Stream #2"), op("c", 18, 2), op("d", 30, 5)]
    idle = profile_decode.idle_time(ops, 2, "call")
    assert idle["span_ms_per_call"] == 35e-3 / 2 and idle["idle_in_span_ms_per_call"] == 13e-3 / 2
    assert idle["largest_gaps"] == [dict(us=10.0, after="c", before="d"), dict(us=3.0, after="b", before="c")]
    assert profile_decode.idle_time([], 1, "call") == {}


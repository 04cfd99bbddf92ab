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
    sources = {row["source"]: row["ms_per_call"] for row in report["top_sources"]}
    attributed = sum(ms for source, ms in sources.items() if source.startswith("zaya_jax/"))
    assert attributed > 0.5 * report["kernel_ms_per_call"], sources
    assert any("scoring.py" in source for source in sources), sources  # the head and log-softmax of the window

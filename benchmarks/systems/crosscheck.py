"""An independent second measurement of the two ceilings the suite reports (copy bandwidth, bf16 GEMM), taken
with PyTorch on the same GPU in the same run, next to ours at identical sizes: if the two disagree by more than
~10%, distrust the harness before the hardware. Skipped (with the reason recorded) where torch or its GPU
build is missing; nothing in zaya_jax imports torch otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.systems import gemm, hbm
from benchmarks.systems.report import write_json

COPY_BYTES = 1 << 30
GEMM_N = 8192


def torch_ceilings(timeout_s: float = 300) -> tuple[dict | None, str | None]:
    """Runs torch_ceilings.py in a child process (torch and jax each load their own CUDA/ROCm libraries; keeping
    them apart avoids version clashes), with ZAYA_TORCH_PYTHON if torch lives in another interpreter.
    Returns (figures, None) or (None, why not)."""
    python = os.environ.get("ZAYA_TORCH_PYTHON", sys.executable)
    script = os.path.join(os.path.dirname(__file__), "torch_ceilings.py")
    cmd = [python, script, str(COPY_BYTES), str(GEMM_N)]
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return None, f"torch measurement timed out after {timeout_s:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None, (done.stderr.strip().splitlines() or ["torch measurement failed"])[-1]
    figures = json.loads(lines[-1])
    return (None, figures["skipped"]) if "skipped" in figures else (figures, None)


def jax_ceilings(copy_bytes: int = COPY_BYTES, n: int = GEMM_N) -> dict:
    copy = hbm.measure("xla", "copy", copy_bytes)
    square = gemm.measure(gemm.GemmShape("square", n, n), n)
    return dict(copy_bandwidth=copy["bandwidth"], gemm_tflops=square["tflops"])


def run(out_dir: str, log=print) -> dict:
    theirs, why = torch_ceilings()
    if theirs is None:
        result = dict(skipped=why)
        log(f"cross-check skipped: {why}")
    else:
        ours = jax_ceilings()
        ratio = {k: ours[k] / theirs[k] for k in ("copy_bandwidth", "gemm_tflops")}
        result = dict(jax=ours, torch=theirs, jax_over_torch=ratio,
                      within_10_percent={k: abs(v - 1) <= 0.10 for k, v in ratio.items()})
        log(f"copy {ours['copy_bandwidth'] / 1e9:.0f} GB/s (torch {theirs['copy_bandwidth'] / 1e9:.0f}), bf16 GEMM "
            f"{ours['gemm_tflops']:.0f} TFLOP/s (torch {theirs['gemm_tflops']:.0f}) at {GEMM_N}^3")
    write_json(f"{out_dir}/crosscheck.json", result)
    return result

"""The project-venv side of the reference harness: runs zaya_reference.py in the reference venv (torch +
transformers, no jax) through a JSON spec and reads back its npz/json results."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
REF_PYTHON = Path(os.environ.get("ZAYA_REF_PYTHON", REPO / ".venv-ref" / "bin" / "python"))
SCRIPT = Path(__file__).with_name("zaya_reference.py")

requires_reference = pytest.mark.skipif(
    not REF_PYTHON.exists(),
    reason=f"HF reference venv not found at {REF_PYTHON} (create it with ./run.sh test, or set ZAYA_REF_PYTHON)")


def run_reference(jobs: list[dict], workdir: Path, timeout: float = 600) -> None:
    """Runs every job in one reference process; fails the test with the reference's stderr on error."""
    spec = workdir / f"spec_{os.getpid()}_{len(list(workdir.glob('spec_*.json')))}.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([str(REF_PYTHON), str(SCRIPT), str(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"HF reference failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


def results(out_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    npz = out_dir / "reference.npz"
    arrays = dict(np.load(npz)) if npz.exists() else {}
    return arrays, json.loads((out_dir / "report.json").read_text())

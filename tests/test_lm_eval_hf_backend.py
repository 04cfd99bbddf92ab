"""`python -m launch.evaluate_lm` on an exported checkpoint scores a multiple-choice task as lm-evaluation-harness's
own `hf` backend scores it with Hugging Face's ZayaForCausalLM on the same directory (the reference venv: PyTorch +
transformers + lm_eval): the same accuracies and, per question and choice, the same log-likelihoods and greedy flags.
The directory carries a byte-level BPE tokenizer.json, so both sides tokenize with the same file. On the GPU at full
size: benchmarks/lm_eval_h200.py."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from hf_reference.client import REF_PYTHON, requires_reference
from hf_reference.jax_side import random_model

from benchmarks.lm_eval_h200 import task_texts, write_bpe_tokenizer

import zaya_jax
from zaya_jax.config import tiny

TASK_DIR = os.path.join(os.path.dirname(__file__), "data", "lm_eval_toy")
CFG = tiny(dtype="float32", vocab_size=320, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, moe_intermediate_size=40, num_experts=4, router_hidden_size=8,
           cca_time0=3, remat="none")


def reference_has_lm_eval() -> bool:
    if not REF_PYTHON.exists():
        return False
    return subprocess.run([str(REF_PYTHON), "-c", "import lm_eval, accelerate"], capture_output=True).returncode == 0


def read_samples(path):
    with open(path) as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


@requires_reference
@pytest.mark.skipif(not reference_has_lm_eval(), reason="lm_eval or accelerate missing in the reference venv "
                    "(./run.sh test installs them)")
def test_evaluate_lm_scores_as_the_hf_backend(tmp_path, monkeypatch):
    from launch import evaluate_lm

    seed = int(np.random.SeedSequence().entropy % 2**31)
    # the skip class at HF's own bias: transformers' from_pretrained resets it to -1 whatever the file holds (spec
    # 5.1), so another value scores tokens that pick the skip class differently on the two sides
    checkpoint = str(zaya_jax.to_hf(random_model(CFG, seed=seed, skip_bias=-1.0), tmp_path / "hf"))
    with open(os.path.join(TASK_DIR, "zaya_toy_mc.jsonl")) as f:
        write_bpe_tokenizer(checkpoint, task_texts([json.loads(line) for line in f]), vocab_size=300)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = evaluate_lm.main(["--checkpoint", checkpoint, "--tasks", "zaya_toy_mc", "--include-path", TASK_DIR,
                             "--max-length", "128", "--samples", str(tmp_path / "ours.jsonl")])["zaya_toy_mc"]

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    # lm_eval's command line (`python -m lm_eval`), its built-in task index read from the toy task's folder (lm_eval
    # finds it next to lm_eval/tasks/manager.py): parsing its thousands of task files costs 30-50 s on 2 cores
    cli = ("import sys; from lm_eval.tasks import manager; manager.__file__ = sys.argv.pop(1); "
           "from lm_eval.__main__ import cli_evaluate; cli_evaluate()")
    proc = subprocess.run([str(REF_PYTHON), "-c", cli, os.path.join(TASK_DIR, "manager.py"), "--model", "hf",
                           "--model_args", f"pretrained={checkpoint},dtype=float32", "--tasks", "zaya_toy_mc", "--include_path",
                           TASK_DIR, "--device", "cpu", "--batch_size", "4", "--output_path", str(tmp_path / "hf_out"),
                           "--log_samples"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results,) = glob.glob(str(tmp_path / "hf_out" / "*" / "results_*.json"))
    (samples,) = glob.glob(str(tmp_path / "hf_out" / "*" / "samples_zaya_toy_mc_*.jsonl"))
    theirs = json.load(open(results))["results"]["zaya_toy_mc"]

    assert ours["acc,none"] == theirs["acc,none"] and ours["acc_norm,none"] == theirs["acc_norm,none"], \
        (ours, theirs, f"seed {seed}")
    ours_samples, hf_samples = read_samples(tmp_path / "ours.jsonl"), read_samples(samples)
    assert sorted(ours_samples) == sorted(hf_samples)
    for doc_id, sample in ours_samples.items():
        mine = np.array([[float(r[0][0]), r[0][1] in (True, "True")] for r in sample["resps"]])
        hf = np.array([[float(r[0][0]), r[0][1] in (True, "True")] for r in hf_samples[doc_id]["resps"]])
        np.testing.assert_allclose(mine[:, 0], hf[:, 0], rtol=0, atol=1e-4, err_msg=f"doc {doc_id}, seed {seed}")
        np.testing.assert_array_equal(mine[:, 1], hf[:, 1], err_msg=f"greedy flags, doc {doc_id}, seed {seed}")

"""lm-evaluation-harness runs against our model through the adapter.

- A local multiple-choice task (tests/data/lm_eval_toy: task YAML + JSON lines, nothing downloaded) scored by
  lm_eval.simple_evaluate reports the accuracy (acc and acc_norm) that a direct loop computes: one plain
  forward per (question, choice) (right-padded to one length), no Scorer, no adapter; the per-choice
  log-likelihoods agree too. `python -m launch.evaluate_lm` on an exported checkpoint reports the same accuracy.
- loglikelihood_rolling equals the sum over lm_eval's own rolling windows (lm_eval.utils), scored directly.
- generate_until returns the decoded greedy continuation cut at the first stop string.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from hf_reference.jax_side import random_model
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import zaya_jax
from zaya_jax.config import tiny
from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.inference import generate
from zaya_jax.inference.lm_eval_adapter import ZayaLM

TASK_DIR = os.path.join(os.path.dirname(__file__), "data", "lm_eval_toy")
CFG = tiny(dtype="float32", vocab_size=320, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=8,
           remat="none")
PAD_TO = 128  # the direct loop's fixed length (right padding: causal, so real positions are unaffected)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=2)


@pytest.fixture(scope="module")
def direct_logprobs(model):
    """log p(ids[i] | ids[:i]) for i >= 1 from one plain forward of one sequence."""
    forward = jax.jit(lambda ids: jax.nn.log_softmax(model(ids), axis=-1))

    def run(ids):
        padded = np.zeros((1, PAD_TO), np.int32)
        padded[0, :len(ids)] = ids
        logp = np.asarray(forward(jnp.asarray(padded)))[0]
        return np.array([logp[i - 1, ids[i]] for i in range(1, len(ids))])

    return run


@pytest.fixture(scope="module")
def direct_mc(direct_logprobs):
    """Per question of the toy task: (acc, acc_norm, choice log-likelihoods) from the direct loop."""
    tok = ByteTokenizer()
    with open(os.path.join(TASK_DIR, "zaya_toy_mc.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    out = []
    for doc in docs:
        context = tok.encode(f"Question: {doc['question']}\nAnswer:").tolist()
        lls = []
        for choice in doc["choices"]:
            continuation = tok.encode(" " + choice).tolist()
            lls.append(direct_logprobs(context + continuation)[-len(continuation):].sum())
        lls = np.array(lls)
        lengths = np.array([len(c) for c in doc["choices"]], float)  # lm_eval: characters of the choice
        out.append((float(np.argmax(lls) == doc["answer"]), float(np.argmax(lls / lengths) == doc["answer"]), lls))
    return out


@pytest.fixture
def offline_datasets(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def toy_tasks_only(**kw):
    """A TaskManager that indexes the include path only: lm_eval's own ~14k task YAML files take 10-20 s to parse
    on each construction, and no test here uses them."""
    return TaskManager(**kw, include_defaults=False)


def test_multiple_choice_accuracy_matches_direct_loop(model, direct_mc, offline_datasets):
    lm = ZayaLM(model, ByteTokenizer(), max_length=PAD_TO, batch_size=8)
    out = lm_eval.simple_evaluate(model=lm, tasks=["zaya_toy_mc"], task_manager=toy_tasks_only(include_path=TASK_DIR),
                                  log_samples=True, bootstrap_iters=0)
    reported = out["results"]["zaya_toy_mc"]
    acc, acc_norm = np.mean([d[0] for d in direct_mc]), np.mean([d[1] for d in direct_mc])
    print(f"\nlm_eval acc {reported['acc,none']:.4f} acc_norm {reported['acc_norm,none']:.4f}; "
          f"direct acc {acc:.4f} acc_norm {acc_norm:.4f} over {len(direct_mc)} questions")
    assert reported["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert reported["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)
    samples = out["samples"]["zaya_toy_mc"]
    assert len(samples) == len(direct_mc)
    for s in samples:
        ours = np.array([r[0][0] for r in s["resps"]])
        np.testing.assert_allclose(ours, direct_mc[s["doc_id"]][2], rtol=1e-5, atol=1e-5)


def test_evaluate_lm_cli_on_an_exported_checkpoint(model, direct_mc, offline_datasets, tmp_path, capsys):
    from launch import evaluate_lm

    checkpoint = zaya_jax.to_hf(model, tmp_path / "hf")
    limit = 8
    results = evaluate_lm.main(["--checkpoint", str(checkpoint), "--tokenizer", "byte", "--tasks", "zaya_toy_mc",
                                "--include-path", TASK_DIR, "--limit", str(limit), "--max-length", "64",
                                "--output", str(tmp_path / "new" / "results.json")])  # its folder is created
    assert results["zaya_toy_mc"]["acc,none"] == pytest.approx(np.mean([d[0] for d in direct_mc[:limit]]))
    assert json.loads((tmp_path / "new" / "results.json").read_text())["zaya_toy_mc"]["acc,none"] == \
        results["zaya_toy_mc"]["acc,none"]
    timing = re.search(r"evaluate_lm: loaded in ([\d.]+) s; log-likelihoods ([\d.]+) s after ([\d.]+) s compiling "
                       r"(\d+) sequence length\(s\); ([\d.]+) s in all", capsys.readouterr().err)
    assert timing and int(timing.group(4)) >= 1
    load, loglikelihoods, compile_, total = (float(timing.group(i)) for i in (1, 2, 3, 5))
    assert load + loglikelihoods + compile_ <= total + 0.3  # parts of the whole (each printed to 0.1 s)


def test_evaluate_lm_indexes_lm_eval_tasks_only_when_asked_for_one():
    from launch.evaluate_lm import task_manager

    class Manager:
        built = []

        def __init__(self, include_path=None, include_defaults=True):
            self.built.append(include_defaults)
            self.all_tasks = ["zaya_toy_mc"] + (["hellaswag"] if include_defaults else [])

    def args(tasks, include_path=TASK_DIR):
        return type("Args", (), dict(tasks=tasks, include_path=include_path))

    assert task_manager(Manager, args("zaya_toy_mc")).all_tasks == ["zaya_toy_mc"] and Manager.built == [False]
    assert "hellaswag" in task_manager(Manager, args("zaya_toy_mc,hellaswag")).all_tasks
    assert "hellaswag" in task_manager(Manager, args("hellaswag", None)).all_tasks
    assert Manager.built == [False, False, True, True]


def test_rolling_loglikelihood_matches_lm_eval_windows(model, direct_logprobs):
    tok = ByteTokenizer()
    max_length = 24
    lm = ZayaLM(model, tok, max_length=max_length, batch_size=4)
    text = "The quick brown fox jumps over the lazy dog; then it naps in the warm afternoon sun."
    ids = tok.encode(text).tolist()
    ours = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    want = 0.0
    for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
            ids, prefix_token=tok.BOS, max_seq_len=max_length, context_len=1)):
        want += direct_logprobs(context + continuation)[-len(continuation):].sum()
    assert len(ids) > 3 * max_length
    assert ours == pytest.approx(want, rel=1e-5)


def test_generate_until_cuts_at_stop_strings(model):
    tok = ByteTokenizer()
    lm = ZayaLM(model, tok, max_length=PAD_TO, batch_size=2)
    prompts = ["Once upon a time", "Q: 2+2="]
    # the same decoder and batch shape as the adapter's: one compile
    free = generate(lm.decoder, [tok.encode(p).tolist() for p in prompts], max_new_tokens=12,
                    stop_tokens=[tok.EOS])
    texts = [tok.decode(np.asarray(free.row(i))) for i in range(len(prompts))]
    stop = texts[0][3:5]  # a stop string that occurs in the first continuation
    requests = [Instance("generate_until", {}, (p, {"until": [stop], "max_gen_toks": 12}), i)
                for i, p in enumerate(prompts)]
    got = lm.generate_until(requests)
    for text, g in zip(texts, got):
        assert g == (text[:text.find(stop)] if stop in text else text)
    assert len(got[0]) <= 3

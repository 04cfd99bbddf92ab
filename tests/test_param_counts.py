"""Parameter counts three ways: the abstract model (nnx.eval_shape, nothing allocated), the closed-form
ModelConfig.param_counts(), and transformers' ZayaForCausalLM built on the meta device. ZAYA1-8B must read as the
paper quotes it: 8.30B non-embedding total, 0.754B active."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_reference.client import REPO, requires_reference, results, run_reference
from zaya_jax.config import preset, tiny
from zaya_jax.param_count import abstract_param_counts, format_param_counts

CONFIGS = {
    "zaya1_8b": preset("zaya1_8b"),
    "tiny": preset("tiny"),
    "tiny_untied_biases": tiny(tie_word_embeddings=False, lm_head_bias=True, attention_bias=True, cca_time0=3,
                               cca_time1=1),
    "tiny_tied_head_bias": tiny(lm_head_bias=True, num_hidden_layers=1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_abstract_model_matches_closed_form(name):
    cfg = CONFIGS[name]
    assert abstract_param_counts(cfg) == cfg.param_counts()


def test_zaya1_8b_reads_as_the_paper_quotes():
    counts = abstract_param_counts(CONFIGS["zaya1_8b"])
    assert counts["non_embedding"] == 8_303_355_728 and counts["active_non_embedding"] == 753_608_528
    assert format_param_counts(counts).startswith("non-embedding parameters: 8.30B total / 0.754B active")


def test_count_cli_prints_the_summary():
    out = subprocess.run([sys.executable, "-m", "launch.convert_hf", "--count", "zaya1_8b"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "8.30B total / 0.754B active" in out


@pytest.mark.hf
@requires_reference
def test_transformers_counts_the_same(tmp_path):
    jobs = [{"mode": "count", "config": cfg.to_hf_dict(), "out_dir": str(tmp_path / name)}
            for name, cfg in CONFIGS.items()]
    run_reference(jobs, tmp_path)
    for name, cfg in CONFIGS.items():
        _, hf_counts = results(tmp_path / name)
        assert hf_counts == abstract_param_counts(cfg), name

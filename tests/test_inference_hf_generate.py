"""Greedy generation equals transformers' ZayaForCausalLM.generate on the same weights: a left-padded batch,
attention biases (the delayed-value state starts at the bias), a stop token that ends one row early (HF then
feeds and emits pad for that row). The step logits of HF's cached generation also match our cached decode."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from hf_reference.client import REF_PYTHON, requires_reference
from hf_reference.jax_side import max_rel, random_model

import zaya_jax
from zaya_jax.config import tiny
from zaya_jax.inference import Decoder, generate_padded

pytestmark = [pytest.mark.hf, requires_reference]

SCRIPT = os.path.join(os.path.dirname(__file__), "hf_reference", "generate_reference.py")
CFG = tiny(dtype="float32", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=4, router_hidden_size=8,
           attention_bias=True, tie_word_embeddings=False, lm_head_bias=True, remat="none")
NEW = 20
LEFT_PADS, T = (4, 0, 2), 8


def run_hf_generate(job: dict, tmp_path):
    spec = tmp_path / "generate_spec.json"
    spec.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(OMP_NUM_THREADS="2", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([str(REF_PYTHON), SCRIPT, str(spec)], capture_output=True, text=True, timeout=600, env=env,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"HF generate failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return dict(np.load(tmp_path / "hf_out" / "reference.npz"))


def test_greedy_generation_matches_hf(tmp_path):
    # transformers resets the skip-class bias to -1 when it loads a checkpoint: use -1 on both sides
    model = random_model(CFG, seed=1, skip_bias=-1.0)
    rng = np.random.default_rng(5)
    ids = rng.integers(3, CFG.vocab_size, (len(LEFT_PADS), T)).astype(np.int32)
    mask = np.ones_like(ids)
    for row, n in enumerate(LEFT_PADS):
        ids[row, :n], mask[row, :n] = CFG.pad_token_id, 0
    decoder = Decoder(model)

    # the stop token: the first token that some row emits for the first time at step >= 3
    free = generate_padded(decoder, ids, mask, max_new_tokens=NEW)
    row, at = next((r, t) for t in range(3, NEW) for r in range(len(ids)) if free.tokens[r, t] not in free.tokens[r, :t])
    stop = int(free.tokens[row, at])
    ours = generate_padded(decoder, ids, mask, max_new_tokens=NEW, stop_tokens=[stop])
    assert ours.lengths[row] == at + 1 and ours.stopped[row]
    assert not ours.stopped.all(), "pick another seed: every row stops"

    directory = zaya_jax.to_hf(model, tmp_path / "model")
    ref = run_hf_generate({"model_dir": str(directory), "out_dir": str(tmp_path / "hf_out"),
                           "input_ids": ids.tolist(), "attention_mask": mask.tolist(), "max_new_tokens": NEW,
                           "eos_token_id": stop, "pad_token_id": CFG.pad_token_id}, tmp_path)
    hf_new = ref["sequences"][:, T:]
    n = hf_new.shape[1]
    print(f"\nHF generated {n} steps; ours {ours.lengths.tolist()} tokens per row, stopped {ours.stopped.tolist()}")
    np.testing.assert_array_equal(ours.tokens[:, :n], hf_new)
    assert (ours.tokens[:, n:] == CFG.pad_token_id).all() and n == ours.lengths.max()

    # teacher-forced on HF's tokens, our cached decode gives HF's per-step logits
    cache = decoder.init_cache(ids.shape[0], T + n)
    logits, cache = decoder.prefill(cache, ids, mask)
    steps = [np.asarray(logits)]
    for t in range(n - 1):
        logits, cache = decoder.step(cache, hf_new[:, t])
        steps.append(np.asarray(logits))
    err = max_rel(np.stack(steps), ref["logits"])
    print(f"step logits vs HF generate: max-rel {err:.2e}")
    assert err <= 2e-5

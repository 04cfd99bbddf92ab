"""Both checkpoint formats load the same model for inference, and `python -m launch.generate` produces the same
text from an Orbax training checkpoint, from a Hugging Face directory and from the in-memory model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference.jax_side import random_model

import zaya_jax
from launch import generate as generate_cli
from zaya_jax.checkpoint.manager import CheckpointError, CheckpointManager
from zaya_jax.config import tiny
from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.inference import Decoder
from zaya_jax.inference.loading import load_model
from zaya_jax.inference.text import complete
from zaya_jax.model.base import BalancingBias

CFG = tiny(dtype="float32", vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=2, router_hidden_size=8,
           remat="none")
PROMPTS = ["Hello", "The weather today is"]


def save_training_checkpoint(model, directory, step):
    """A checkpoint laid out as the trainer writes it (state params/model_state as pure dicts, meta model)."""
    _, params, model_state = nnx.split(model, nnx.Param, BalancingBias)
    state = {"step": jnp.int32(step), "params": nnx.to_pure_dict(params),
             "model_state": nnx.to_pure_dict(model_state)}
    mngr = CheckpointManager(str(directory / "checkpoints"), async_save=False)
    mngr.save(step, state, data={}, meta={"model": model.cfg.to_hf_dict(), "seq_len": 16}, force=True)
    mngr.close()


def test_generate_cli_from_orbax_and_hf_checkpoints(tmp_path, capsys):
    model = random_model(CFG, seed=9)
    run = tmp_path / "run"
    save_training_checkpoint(model, run, step=3)
    hf_dir = zaya_jax.to_hf(model, tmp_path / "hf")

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    ids = jnp.asarray([[5, 60, 7, 90, 11]])
    want = np.asarray(forward(state, ids))
    for path in (run, run / "checkpoints", hf_dir):
        loaded = nnx.state(load_model(path))
        np.testing.assert_array_equal(np.asarray(forward(loaded, ids)), want)

    expected = complete(Decoder(model), ByteTokenizer(), PROMPTS, max_new_tokens=10)
    common = ["--max-new-tokens", "10", "--tokenizer", "byte"] + [a for p in PROMPTS for a in ("--prompt", p)]
    from_orbax = generate_cli.main(["--checkpoint", str(run), "--step", "3"] + common)
    from_hf = generate_cli.main(["--checkpoint", str(hf_dir)] + common)
    assert from_orbax == from_hf == expected
    printed = capsys.readouterr().out
    assert all(p + t in printed for p, t in zip(PROMPTS, expected))


def test_a_bf16_load_stores_bf16_parameters_from_both_formats(tmp_path):
    """Inference in bf16 holds the parameters in bf16 (the fp32 file's values rounded once), not an fp32 copy cast
    on every call; the balancing biases stay fp32."""
    model = random_model(CFG, seed=9)
    save_training_checkpoint(model, tmp_path / "run", step=3)
    hf_dir = zaya_jax.to_hf(model, tmp_path / "hf")
    want = [np.asarray(x.astype(jnp.bfloat16)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    for path in (tmp_path / "run", hf_dir):
        loaded = load_model(path, dtype="bfloat16")
        assert loaded.cfg.param_dtype == "bfloat16"
        got = jax.tree.leaves(nnx.state(loaded, nnx.Param))
        assert [x.dtype for x in got] == [jnp.bfloat16] * len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), b)
        assert {x.dtype for x in jax.tree.leaves(nnx.state(loaded, BalancingBias))} == {jnp.dtype(jnp.float32)}


def test_missing_orbax_step_is_reported(tmp_path):
    model = random_model(CFG, seed=9)
    save_training_checkpoint(model, tmp_path, step=3)
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        load_model(tmp_path, step=7)
    with pytest.raises(CheckpointError, match=f"folder of one step: pass its run, --checkpoint {tmp_path} --step 3"):
        load_model(tmp_path / "checkpoints" / "3")


def test_an_unreadable_latest_step_falls_back_like_training(tmp_path, capsys):
    import os
    good = random_model(CFG, seed=9)
    save_training_checkpoint(good, tmp_path, step=3)
    save_training_checkpoint(random_model(CFG, seed=10), tmp_path, step=5)
    for root, _, files in os.walk(tmp_path / "checkpoints" / "5" / "state"):  # truncate step 5's data files
        for f in files:
            open(os.path.join(root, f), "wb").close()
    loaded = load_model(tmp_path)
    assert "step 5 cannot be read" in capsys.readouterr().err
    for a, b in zip(jax.tree.leaves(nnx.state(good, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert os.path.isdir(tmp_path / "checkpoints" / "5")  # a reader leaves the run directory alone
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'checkpoints'} step 5 cannot be read"):
        load_model(tmp_path, step=5)  # asked for by number: no other step stands in

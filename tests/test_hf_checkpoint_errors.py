"""Bad Hugging Face checkpoints fail with a ZayaCheckpointError whose message names the problem."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zaya_jax
from hf_reference.jax_side import random_model
from zaya_jax import ZayaCheckpointError
from zaya_jax.config import tiny

CFG = tiny(num_hidden_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
           head_dim=16, moe_intermediate_size=32, num_experts=2, router_hidden_size=8, dtype="float32")
Q_PROJ = "model.layers.1.self_attn.qkv_proj.q_proj.weight"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return zaya_jax.to_hf(random_model(CFG, 0), tmp_path_factory.mktemp("good") / "hf")


@pytest.fixture
def ckpt(good_dir, tmp_path):
    """A fresh copy of a valid checkpoint for the test to break."""
    return shutil.copytree(good_dir, tmp_path / "hf")


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def load_error(path) -> str:
    with pytest.raises(ZayaCheckpointError) as info:
        zaya_jax.from_hf(path)
    return str(info.value)


def test_good_checkpoint_loads(good_dir):
    assert zaya_jax.from_hf(good_dir).cfg == CFG


def test_missing_directory(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    assert "no config.json" in load_error(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(ckpt)


def test_not_a_zaya_config(ckpt):
    edit_config(ckpt, model_type="llama")
    msg = load_error(ckpt)
    assert "'llama'" in msg and "not a ZAYA checkpoint" in msg


def test_config_value_zaya_cannot_take(ckpt):
    edit_config(ckpt, num_experts_per_tok=2)
    assert "num_experts_per_tok" in load_error(ckpt)


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    assert "no weights" in load_error(ckpt)


def test_missing_key(ckpt):
    edit_tensors(ckpt, lambda t: t.pop(Q_PROJ))
    msg = load_error(ckpt)
    assert "missing" in msg and Q_PROJ in msg


def test_unexpected_key(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": np.zeros((2, 2), np.float32)}))
    msg = load_error(ckpt)
    assert "unexpected" in msg and "model.layers.0.mlp.shared_expert.weight" in msg


def test_wrong_shape(ckpt):
    edit_tensors(ckpt, lambda t: t.update({Q_PROJ: np.zeros((16, 32), np.float32)}))
    msg = load_error(ckpt)
    assert Q_PROJ in msg and "[16, 32]" in msg and "[32, 32]" in msg


def test_config_that_does_not_match_the_tensors(ckpt):
    edit_config(ckpt, num_experts=3)  # every expert/router tensor now has the wrong leading size
    msg = load_error(ckpt)
    assert "shape" in msg and "config.json implies" in msg


def test_non_float_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.update({Q_PROJ: t[Q_PROJ].astype(np.int32)}))
    assert f"{Q_PROJ} has dtype I32" in load_error(ckpt)


def test_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {Q_PROJ: "model-00002-of-00002.safetensors"}}))
    assert "model-00002-of-00002.safetensors" in load_error(ckpt)


def test_export_refuses_to_mix_with_existing_weights(good_dir, tmp_path):
    model = zaya_jax.from_hf(good_dir)
    target = zaya_jax.to_hf(model, tmp_path / "out", max_shard_bytes=20_000)
    with pytest.raises(ZayaCheckpointError, match="already holds weights"):
        zaya_jax.to_hf(model, target)
    zaya_jax.to_hf(model, target, overwrite=True)  # replaces the shards and the index by one file
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_a_failed_overwrite_keeps_the_old_weights(good_dir, tmp_path, monkeypatch):
    from zaya_jax.checkpoint import safetensors_io
    model = zaya_jax.from_hf(good_dir)
    target = zaya_jax.to_hf(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real, calls = safetensors_io.save_file, []

    def disk_fills_up(*args, **kwargs):  # the first shard is written, the second finds the disk full
        calls.append(args[1])
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors_io, "save_file", disk_fills_up)
    with pytest.raises(OSError, match="No space left"):
        zaya_jax.to_hf(model, target, max_shard_bytes=20_000, overwrite=True)
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # no temporary shard left either
    monkeypatch.undo()
    assert zaya_jax.from_hf(target).cfg == CFG


def test_cli_export_to_a_file_is_one_line(good_dir, tmp_path):
    from launch import convert_hf
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    with pytest.raises(SystemExit, match=f"^convert_hf: {target} is a file, not a directory"):
        convert_hf.main([str(good_dir), "--roundtrip", str(target), "--overwrite"])
    assert target.read_text() == "mine\n"
    with pytest.raises(SystemExit, match=r"^convert_hf: .*notes.txt/out: Not a directory$"):
        convert_hf.main([str(good_dir), "--roundtrip", str(target / "out")])

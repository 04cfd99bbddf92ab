"""The run config's groups typed and checked once (zaya_jax/train/options.py, step_options.py): defaults applied,
unknown keys and values of the wrong type refused in one line naming them, option combinations that cannot work
refused before any model is built, and the train step's conditional options resolved in one place."""

import runpy

import numpy as np
import pytest
from ml_collections import ConfigDict

from configs.default import get_config
from zaya_jax.config import ConfigError, preset
from zaya_jax.train import loop, program
from zaya_jax.train.errors import TrainConfigError
from zaya_jax.train.options import BatchRamp, run_options
from zaya_jax.train.step_options import step_options


def refused(config, *words):
    """run_options(config) raises one line holding every word."""
    with pytest.raises(TrainConfigError) as e:
        run_options(config)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


@pytest.mark.parametrize("group,key", [("train", "stepz"), ("data", "seqlen"), ("optim", "lr"),
                                       ("parallel", "zero2"), ("balancing", "rate"), ("mesh", "pipeline")])
def test_an_unknown_key_is_refused_by_name(group, key):
    c = get_config()
    with c[group].unlocked():
        c[group][key] = 1
    refused(c, f"{group}:", repr(key))


def test_unknown_nested_keys_and_groups_are_refused():
    c = get_config()
    c.train.batch_ramp.start_token = 5
    refused(c, "train.batch_ramp:", "'start_token'")
    c = get_config()
    c.trian = ConfigDict(dict(steps=3))
    refused(c, "config:", "'trian'")


@pytest.mark.parametrize("key,value,words", [
    ("train.cast_weights_once", "yes", ["train.cast_weights_once='yes'", "true or false"]),
    ("train.steps", 2.5, ["train.steps=2.5", "whole number"]),
    ("train.grads_per_pass", True, ["train.grads_per_pass=True", "whole number"]),
    ("train.ce_chunk_tokens", -8, ["train.ce_chunk_tokens=-8"]),
    ("data.reset_at_documents", 1, ["data.reset_at_documents=1"]),
    ("data.prefetch", -1, ["data.prefetch=-1"]),
    ("parallel.context_attention", "ulysses", ["parallel.context_attention='ulysses'"]),
    ("parallel.muon_placement", "rows", ["parallel.muon_placement='rows'"]),
    ("optim.warmup_steps", "ten", ["optim.warmup_steps='ten'"])])
def test_a_value_of_the_wrong_type_or_range_is_named(key, value, words):
    c = get_config()
    group, name = key.split(".")
    with c[group].unlocked():
        del c[group][name]  # ml-collections keeps a field's type: set the bad value as a new key
        c[group][name] = value
    refused(c, *words)


def test_defaults_are_applied_to_keys_a_config_leaves_out():
    c = ConfigDict(dict(
        model=ConfigDict(dict(preset="tiny")),
        data=ConfigDict(dict(seq_len=64, weights=ConfigDict(dict(web=0.5, code=0.5)))),
        train=ConfigDict(dict(steps=10, global_batch_tokens=256, microbatch_tokens=128, log_every=1,
                              checkpoint_every=5, eval_every=None)),
        optim=ConfigDict(dict(warmup_steps=2))))
    o = run_options(c)
    t = o.train
    assert (t.eval_every, t.eval_batches, t.keep_checkpoints, t.init_from, t.peak_tflops) == (0, None, None, "", 0.0)
    assert (t.ce_chunk_tokens, t.cast_weights_once, t.per_layer_view, t.grads_per_pass) == (0, True, True, 1)
    assert t.defer_expert_wgrad and t.fault == "" and t.batch_ramp == BatchRamp(0, 0)
    assert o.seed == 0 and o.data.tokenizer == "byte" and o.data.builtin and not o.data.reset_at_documents
    assert o.optim.total_steps == 10  # the schedule follows train.steps when the config gives none
    assert o.parallel.zero1 and o.balancing.learning_rate == 1.0 and o.mesh.data == -1 and o.mesh.num_devices == 0
    assert program.make_plan(c).accumulation == 2


def test_numpy_scalars_are_taken_as_python_values():
    c = get_config()
    with c.train.unlocked():
        del c.train.steps
        c.train.steps = np.int64(70)
    assert run_options(c).train.steps == 70 and type(run_options(c).train.steps) is int


def test_a_missing_required_key_is_named():
    c = get_config()
    del c.train["microbatch_tokens"]
    refused(c, "train.microbatch_tokens is missing")


def test_data_combinations_are_refused_by_the_plan():
    c = get_config()
    c.data.sources = ConfigDict(dict(web="/data/web"))
    refused(c, "data.builtin is True", "web")
    c = get_config()
    c.data.weights = ConfigDict(dict(web=1.0))  # the built-in corpus is web and code
    refused(c, "data.weights names ['web']", "['code', 'web']")
    c = get_config()
    c.data.builtin = False
    c.data.sources = ConfigDict(dict(web="/data/web", math="/data/math"))
    refused(c, "data.weights names ['code', 'web']", "['math', 'web']")


def test_a_trainer_error_is_a_config_error():
    assert issubclass(TrainConfigError, ConfigError)


def test_shipped_and_benchmark_configs_pass():
    for path in ("benchmarks/routing_bench_config.py",):
        run_options(runpy.run_path(path)["get_config"]())


@pytest.fixture
def no_model_built(monkeypatch):
    """Building the model or its state fails the test: a refusal must come before either."""
    def built(*_, **__):
        raise AssertionError("a model was built")

    monkeypatch.setattr(program, "graphdef_of", built)
    monkeypatch.setattr(program, "state_creator", built)


def test_a_microbatch_that_does_not_split_over_the_devices_is_refused_before_a_model_is_built(tmp_path,
                                                                                              no_model_built):
    c = get_config()
    c.train.update(dict(global_batch_tokens=6 * 128, microbatch_tokens=6 * 128))
    c.mesh.num_devices = 4
    with pytest.raises(TrainConfigError, match=r"^microbatch of 6 sequences does not split over data=4"):
        loop.run(c, str(tmp_path), log=lambda *_: None)


def test_a_one_layer_model_is_refused_before_a_model_is_built(tmp_path, no_model_built):
    """Its empty inter-layer router scales ([0, R]) cannot be checkpointed: the run used to fail at its first save."""
    c = get_config()
    c.model.overrides.num_hidden_layers = 1
    with pytest.raises(TrainConfigError, match=r"^model num_hidden_layers=1: training needs at least 2 layers"):
        loop.run(c, str(tmp_path), log=lambda *_: None)


def test_deferred_expert_gradients_are_resolved_in_one_place():
    c = get_config()
    c.train.update(dict(global_batch_tokens=4 * 128 * 16))  # 4 microbatches
    o = run_options(c)
    unrolled = preset("tiny", scan_layers=False, moe_impl="pallas", dtype="bfloat16")
    one = step_options(o, unrolled, several_devices=False, accumulation=4)
    assert one.defer_expert_wgrad and one.per_layer_view and one.compute_dtype == "bfloat16" and not one.note
    many = step_options(o, unrolled, several_devices=True, accumulation=4)
    assert not many.defer_expert_wgrad and "several devices" in many.note
    scanned = step_options(o, preset("tiny", moe_impl="pallas"), several_devices=False, accumulation=4)
    assert not scanned.per_layer_view and not scanned.defer_expert_wgrad and "lax.scan" in scanned.note
    ragged = step_options(o, preset("tiny", scan_layers=False), several_devices=False, accumulation=4)
    assert not ragged.defer_expert_wgrad and "moe_impl 'ragged'" in ragged.note


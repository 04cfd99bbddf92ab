"""The README's command-line syntax builds the config launch.train and launch.evaluate run with (issue #34 item 1):
sources, held-out sources, weights and any ModelConfig field by name, for every shipped config; contradictory
settings are refused in one line. Parsed exactly as the launchers parse (absl flags + ml-collections)."""

import os

import pytest
from absl import flags
from ml_collections import config_flags

from zaya_jax.config import ConfigError, RopeConfig
from zaya_jax.train.cli_config import command_line_config, split_open_flags
from zaya_jax.train.loop import TrainConfigError, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*args, config="default"):
    """What `python -m launch.train --config configs/CONFIG.py ARGS` resolves to."""
    argv = ["launch.train", f"--config={ROOT}/configs/{config}.py", *args]
    rest, open_flags = split_open_flags(argv)
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=rest)
    fv(rest)
    return command_line_config(fv["config"], open_flags)


@pytest.mark.parametrize("name", ["default", "zaya1_base", "phase1_pretrain", "anneal"])
def test_readme_data_syntax_on_every_config(name):
    c = parse("--config.data.sources.web=/data/web_text_document", "--config.data.valid_sources.web=/data/web_valid",
              "--config.data.sources.code", "/data/code", config=name)
    assert dict(c.data.sources) == {"web": "/data/web_text_document", "code": "/data/code"}
    assert dict(c.data.valid_sources) == {"web": "/data/web_valid"}
    assert c.data.builtin is False
    if name in ("default", "zaya1_base"):  # the built-in corpus's weights (same names) / equal weights
        assert set(c.data.weights) == {"web", "code"}


@pytest.mark.parametrize("weights", [(), ("--config.data.weights.web=2.0",)], ids=["no_weights", "weights"])
def test_turning_the_builtin_corpus_off_by_hand_drops_its_weights_too(weights):
    """Naming sources turns the built-in corpus off by itself; saying so as well must not keep its weights (the
    command line cannot delete the 'code' weight that the file gave the built-in corpus)."""
    c = parse("--config.data.builtin=False", "--config.data.sources.web=W", *weights)
    assert c.data.builtin is False and dict(c.data.weights) == {"web": 2.0 if weights else 1.0}
    make_plan(c)


def test_weights_and_model_fields_by_name():
    c = parse("--config.data.sources.web=W", "--config.data.sources.code=C", "--config.data.weights.web=0.7",
              "--config.data.weights.code=0.3", "--config.model.overrides.vocab_size=1024",
              "--config.model.overrides.tie_word_embeddings=false", "--config.model.overrides.rms_norm_eps=1e-6",
              "--config.model.overrides.eos_token_id=None", "--config.model.overrides.dtype=bfloat16")
    assert dict(c.data.weights) == {"web": 0.7, "code": 0.3}
    plan = make_plan(c)
    assert plan.model.vocab_size == 1024 and plan.model.tie_word_embeddings is False
    assert plan.model.rms_norm_eps == 1e-6 and plan.model.eos_token_id is None and plan.model.dtype == "bfloat16"
    assert plan.model.remat == "none"  # the file's own override kept
    rope = parse("--config.model.overrides.rope.hybrid.theta=1e6", "--config.model.overrides.rope.hybrid"
                 ".partial_rotary_factor=0.25")
    assert make_plan(rope).model.rope["hybrid"] == RopeConfig(1e6, 0.25)
    base = parse("--config.model.overrides.rope={'hybrid': {'theta': 5e5}}", config="zaya1_base")
    assert make_plan(base).model.rope["hybrid"].theta == 5e5


def test_contradictions_and_typos_are_one_line():
    with pytest.raises(TrainConfigError, match=r"^--config.data.builtin=True contradicts data.sources \(web\)"):
        parse("--config.data.builtin=True", "--config.data.sources.web=W")
    with pytest.raises(TrainConfigError, match="data.valid_sources needs data.sources"):
        parse("--config.data.valid_sources.web=W")
    with pytest.raises(ConfigError, match="ModelConfig has no field 'vocab'"):
        parse("--config.model.overrides.vocab=7")
    with pytest.raises(ConfigError, match="overrides.vocab_size=big: not a value of type int"):
        parse("--config.model.overrides.vocab_size=big")
    with pytest.raises(TrainConfigError, match="data.weights.web=heavy: not a number"):
        parse("--config.data.sources.web=W", "--config.data.weights.web=heavy")


def test_the_builtin_corpus_switched_on_over_a_config_for_named_sources_mixes_its_sources_equally():
    c = parse("--config.data.builtin=True", config="zaya1_base")
    assert c.data.builtin and dict(c.data.weights) == {"web": 1.0, "code": 1.0}
    make_plan(c)


def test_dict_form_turns_the_builtin_corpus_off():
    c = parse("--config.data.sources={'web': '/data/web'}")
    assert c.data.builtin is False and dict(c.data.sources) == {"web": "/data/web"}
    assert dict(c.data.weights) == {"web": 1.0}


def test_weights_for_sources_of_other_names_replace_the_builtin_corpus_weights():
    c = parse("--config.data.sources.txt=A", "--config.data.sources.js=B", "--config.data.weights.txt=0.2",
              "--config.data.weights.js=0.8")
    assert dict(c.data.weights) == {"txt": 0.2, "js": 0.8}
    make_plan(c)  # every source has a weight and no weight names a missing source


def test_a_resume_reads_its_overrides_against_the_recorded_config(tmp_path):
    """`launch.train --workdir RUN --config.optim.muon_gram_impl=xla` on a run started from configs/zaya1_base.py:
    the key is the recorded config's (configs/default.py has no such key)."""
    from zaya_jax.train import run_record
    from zaya_jax.train.cli_config import define_config_flag
    run = str(tmp_path / "run")
    started = parse("--config.model.preset=tiny", "--config.data.tokenizer=byte", config="zaya1_base")
    run_record.ensure(started, run, resuming=False, log=lambda *_: None)
    argv = ["launch.train", f"--workdir={run}", "--config.optim.muon_gram_impl=xla", "--config.train.steps=7"]
    rest, open_flags = split_open_flags(argv)
    fv = flags.FlagValues()
    define_config_flag(f"{ROOT}/configs/default.py", rest, "runs/default", "config", flag_values=fv, sys_argv=rest)
    flags.DEFINE_string("workdir", None, "", flag_values=fv)
    fv(rest)
    c = command_line_config(fv["config"], open_flags, run)
    assert c.optim.muon_gram_impl == "xla" and c.train.steps == 7 and c.model.preset == "tiny"
    assert started.optim.muon_gram_impl == "pallas"  # the change is the command line's

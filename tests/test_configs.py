"""Every shipped config builds a valid run plan; phases chain through init_from; the MoE batch arithmetic."""

import importlib

import pytest

from zaya_jax.train.loop import TrainConfigError, make_plan

CONFIGS = ["default", "zaya1_base", "phase1_pretrain", "phase2_pretrain", "phase3_context_ext", "anneal"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_a_plan(name):
    c = importlib.import_module(f"configs.{name}").get_config()
    plan = make_plan(c)
    assert plan.steps > 0 and plan.micro_rows * plan.seq_len * plan.accumulation == c.train.global_batch_tokens
    if c.data.weights:  # the base config leaves the mixture to its phases
        assert sum(dict(c.data.weights).values()) == pytest.approx(1.0)


def test_phase_chain_and_the_papers_numbers():
    get = lambda n: importlib.import_module(f"configs.{n}").get_config()  # noqa: E731
    p1, p2, p3, an = (get(n) for n in ("phase1_pretrain", "phase2_pretrain", "phase3_context_ext", "anneal"))
    assert p1.train.global_batch_tokens == 2 ** 24 and p1.data.seq_len == 4096
    assert p2.train.init_from == "runs/phase1" and p3.train.init_from == "runs/phase2"
    assert an.train.init_from == "runs/phase3"
    assert p3.data.seq_len == 32768 and p3.mesh.context == 2
    assert abs(p3.train.global_batch_tokens - 30e6) / 30e6 < 0.01
    assert make_plan(p3).model.rope["hybrid"].theta == 1e6 and make_plan(p1).model.rope["hybrid"].theta == 1e4


def test_bad_batch_arithmetic_is_named():
    c = importlib.import_module("configs.default").get_config()
    c.train.microbatch_tokens = 1000
    with pytest.raises(TrainConfigError, match="microbatch_tokens=1000 is not a multiple of data.seq_len=128"):
        make_plan(c)
    c = importlib.import_module("configs.default").get_config()
    c.train.grads_per_pass = 0
    with pytest.raises(TrainConfigError, match="train.grads_per_pass=0 must be >= 1"):
        make_plan(c)


def test_batch_ramp_in_tokens():
    c = importlib.import_module("configs.default").get_config()
    c.train.update(dict(global_batch_tokens=8 * 256, microbatch_tokens=256))
    c.data.seq_len = 128
    c.train.batch_ramp.update(dict(start_tokens=512, ramp_tokens=8192))
    plan = make_plan(c)
    assert plan.ramp[0] == 2 and plan.ramp == tuple(sorted(plan.ramp)) and max(plan.ramp) <= 8
    assert sum(plan.ramp) * 256 >= 8192 > (sum(plan.ramp) - plan.ramp[-1]) * 256
    assert [plan.accumulation_at(s) for s in range(len(plan.ramp) + 2)] == list(plan.ramp) + [8, 8]


def test_cudnn_attention_on_several_devices_is_named():
    from zaya_jax.train.loop import setup
    c = importlib.import_module("configs.default").get_config()
    c.model.overrides.attention_impl = "cudnn"
    c.mesh.num_devices = 2
    with pytest.raises(TrainConfigError, match="attention_impl='cudnn' runs on one device only"):
        setup(c, log=lambda *_: None)


@pytest.mark.parametrize("field", ["model.overrides.solve_impl", "optim.muon_gram_impl"])
def test_pallas_kernels_on_several_cpu_devices_are_named(field):
    """Interpret mode (the CPU's Pallas) cannot run in the multi-device step: a one-line refusal, not JAX's
    varying-axes or mesh error from inside the trace."""
    from zaya_jax.train.loop import setup
    c = importlib.import_module("configs.default").get_config()
    *path, name = field.split(".")
    node = c
    for key in path:
        node = node[key]
    node[name] = "pallas"
    c.mesh.num_devices = 2
    with pytest.raises(TrainConfigError, match=f"{field}='pallas': on the CPU the Pallas kernels run in interpret"):
        setup(c, log=lambda *_: None)

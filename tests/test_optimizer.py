"""The Muon/AdamW partition on the real ZAYA1 parameter tree, the start-up table, schedules, clipping and
learning-rate read-back. (Gradient accumulation lives in the train step: tests/test_train_accumulation.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zaya_jax.config import tiny, zaya1_8b
from zaya_jax.model.zaya import ZayaForCausalLM
from zaya_jax.optim import partition
from zaya_jax.optim.optimizer import (OptimizerConfig, build_optimizer, learning_rates, make_schedule,
                                      optimizer_state_bytes, partition_rows, partition_table)
from zaya_jax.optim.schedules import warmup_cosine, warmup_stable_decay

MUON_SUFFIXES = {
    "self_attn/qkv_proj/q_proj/weight", "self_attn/qkv_proj/k_proj/weight",
    "self_attn/qkv_proj/v_proj_current/weight", "self_attn/qkv_proj/v_proj_delayed/weight",
    "self_attn/o_proj/weight", "mlp/experts/gate_up_proj", "mlp/experts/down_proj", "mlp/gate/down_proj/weight",
    "mlp/gate/router_mlp/fc1/weight", "mlp/gate/router_mlp/fc2/weight",
}
DECAYED_ADAMW = {"model/embed_tokens/weight", "model/layers/mlp/gate/router_mlp/out_proj/weight"}


def abstract_params(cfg):
    model = nnx.eval_shape(lambda: ZayaForCausalLM(cfg))
    return nnx.split(model, nnx.Param, ...)[1]


@pytest.fixture(scope="module")
def tiny_params():
    return abstract_params(tiny())


def random_like(tree, seed):
    rng = np.random.default_rng(seed)  # NumPy: jax.random compiles one program per leaf shape
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), tree)


def test_partition_of_the_zaya1_parameter_tree(tiny_params):
    rows = {r.path: r for r in partition_rows(tiny_params, OptimizerConfig())}
    muon = {p for p, r in rows.items() if r.group == partition.MUON}
    assert muon == {"model/layers/" + s for s in MUON_SUFFIXES}
    decayed = {p for p, r in rows.items() if r.decayed}
    assert decayed == muon | DECAYED_ADAMW
    # Balancing biases are not parameters; the router head, conv kernels and temperatures go to AdamW.
    assert not any("balancing_biases" in p for p in rows)
    for p in ("model/layers/mlp/gate/router_mlp/out_proj/weight", "model/layers/self_attn/qk_norm/temp",
              "model/layers/self_attn/qkv_proj/conv_qk_grouped/weight", "model/router_states_scale"):
        assert rows[p].group == partition.ADAMW
    experts = rows["model/layers/mlp/experts/gate_up_proj"]
    assert experts.matrices == 4 * 8  # every expert of every layer orthogonalised on its own


def test_table_counts_and_state_bytes_at_zaya1_8b_size():
    """Abstract shapes only: the full 8.84B-parameter tree, nothing allocated."""
    cfg = zaya1_8b()
    params = abstract_params(cfg)
    rows = partition_rows(params, OptimizerConfig())
    assert sum(r.params for r in rows) == cfg.param_counts()["total"]
    muon_rows = [r for r in rows if r.group == partition.MUON]
    assert sum(r.matrices for r in muon_rows) == 40 * (16 * 2 + 5 + 3)  # experts, q/k/v/v/o, router matrices
    for r in rows:  # Muon keeps one fp32 momentum, AdamW two fp32 moments
        assert r.state_bytes == (4 if r.group == partition.MUON else 8) * r.params, r.path
    opt_cfg = OptimizerConfig()
    tx = build_optimizer(opt_cfg, log=None)
    buffers = sum(r.state_bytes for r in rows)  # no accumulation buffer: the train step accumulates
    assert buffers <= optimizer_state_bytes(params, tx) <= buffers + 4096
    table = partition_table(params, opt_cfg, tx)
    assert "model/layers/mlp/experts/gate_up_proj" in table and "1600 matrices" in table


def test_update_on_an_nnx_state_under_jit(tiny_params):
    params = random_like(tiny_params, 0)
    grads = random_like(tiny_params, 1)
    lines = []
    cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant", weight_decay=0.0)
    tx = build_optimizer(cfg, params, log=lines.append)
    assert "gate_up_proj" in lines[0]
    rms_tree = jax.jit(lambda g, s, p: jax.tree.map(lambda u: jnp.sqrt(jnp.mean(u**2)), tx.update(g, s, p)[0]))
    for kp, rms in jax.tree_util.tree_leaves_with_path(rms_tree(grads, tx.init(params), params)):
        path = partition.param_path(kp)
        rms = float(rms)
        if partition.group_of(path) == partition.MUON:  # Moonlight scale: AdamW-like RMS 0.2 * lr
            assert 0.15e-2 <= rms <= 0.22e-2, (path, rms)
        else:  # AdamW's first step is lr * sign(g)
            np.testing.assert_allclose(rms, 1e-2, rtol=1e-3, err_msg=path)


@pytest.mark.parametrize("cooldown", ["linear", "1-sqrt"])
def test_warmup_stable_decay(cooldown):
    sched = warmup_stable_decay(1.0, 10, 100, decay_steps=20, cooldown=cooldown, end_value=0.1)
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.5)
    assert [float(sched(s)) for s in (10, 50, 80)] == [1.0, 1.0, 1.0]
    progress = 0.25
    expect = 1.0 - 0.9 * (progress if cooldown == "linear" else progress**0.5)
    assert float(sched(85)) == pytest.approx(expect)
    assert float(sched(100)) == pytest.approx(0.1) and float(sched(1000)) == pytest.approx(0.1)
    steps = jnp.arange(0, 101)
    values = jax.jit(jax.vmap(sched))(steps)  # traced steps, as inside inject_hyperparams
    assert bool(jnp.all(jnp.diff(values[10:]) <= 1e-7))
    with pytest.raises(ValueError):
        warmup_stable_decay(1.0, 90, 100, decay_steps=20)


def test_warmup_cosine():
    sched = warmup_cosine(2.0, 10, 110, end_value=0.2)
    assert float(sched(5)) == pytest.approx(1.0)
    assert float(sched(10)) == pytest.approx(2.0)
    assert float(sched(60)) == pytest.approx(1.1)  # half way: mean of peak and end
    assert float(sched(110)) == pytest.approx(0.2)


def test_gradient_clipping_is_global_over_both_groups():
    """After one step the Muon momentum holds the gradient it received and AdamW's mu holds (1 - b1) times its
    gradient: together they must have the clipped global norm."""
    params = {"q_proj": {"weight": jnp.zeros((16, 32))}, "norm": {"weight": jnp.zeros((32,))}}
    grads = random_like(params, 3)
    grads = jax.tree.map(lambda g: 50.0 * g, grads)
    cfg = OptimizerConfig(clip_norm=1.0, schedule="constant")
    tx = build_optimizer(cfg, log=None)
    _, state = tx.update(grads, tx.init(params), params)
    buffers = lambda name: [v for _, v in optax.tree.get_all_with_path(state, name) if isinstance(v, dict)]
    (momentum,), (mu,) = buffers("momentum"), buffers("mu")  # (the scalar hyperparameter is also "momentum")
    seen = jnp.sqrt(jnp.sum(momentum["q_proj"]["weight"] ** 2) + jnp.sum((mu["norm"]["weight"] / 0.1) ** 2))
    assert float(seen) == pytest.approx(1.0, rel=1e-4)


def test_learning_rates_follow_the_schedule():
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=4, total_steps=20, muon_lr_multiplier=2.0)
    params = {"k_proj": {"weight": jnp.zeros((8, 8))}, "bias": jnp.zeros((8,))}
    tx = build_optimizer(cfg, log=None)
    state = tx.init(params)
    sched = make_schedule(cfg)
    step = jax.jit(tx.update)
    for i in range(6):
        _, state = step(random_like(params, i), state, params)
        lrs = learning_rates(state)
        assert float(lrs["adamw"]) == pytest.approx(float(sched(i)))
        assert float(lrs["muon"]) == pytest.approx(2.0 * float(sched(i)))


def test_rejects_a_vector_that_matches_a_muon_rule():
    with pytest.raises(ValueError, match="Muon needs matrices"):
        build_optimizer(OptimizerConfig(), {"experts": {"down_proj": jnp.zeros((8,))}}, log=None)

"""Compute-dtype weights cast once per optimizer step (zaya_jax/model/compute_view.py):
  * every listed path names a leaf of the model's parameters (a stale path would silently cast nothing);
  * loss and gradients at the bf16 view equal those at the fp32 parameters (the cast's transpose upcasts the same
    bf16 cotangents), so the listed leaves have no fp32 use;
  * the accumulating step with the view gives the same new state as without it, on one device and through the
    trainer's shard_map gradients with ZeRO-1 on 4 emulated devices, and it casts the experts' weights before the
    microbatch loop, not in it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_train_accumulation import BALANCER, OPTIM, stacked_batches

from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.compute_view import COMPUTE_DTYPE_LEAVES, compute_view
from zaya_jax.model.base import BalancingBias
from zaya_jax.optim.optimizer import build_optimizer
from zaya_jax.parallel.data_parallel import sharded_value_and_grad
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.parallel.sharding import state_shardings, zero1, zero1_spec_fn
from zaya_jax.train.loop import init_state
from zaya_jax.train.step import make_accumulating_train_step, make_local_loss_sums, make_loss_fn


def bf16_config():
    return preset("tiny", dtype="bfloat16", num_hidden_layers=2, remat="none")


def leaf_at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_every_listed_leaf_exists_and_is_cast():
    cfg = bf16_config()
    _, params, _ = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=0)), nnx.Param, BalancingBias)
    params = nnx.to_pure_dict(params)
    view = jax.eval_shape(lambda p: compute_view(p, cfg.dtype), params)
    for path in COMPUTE_DTYPE_LEAVES:
        assert leaf_at(params, path).dtype == jnp.float32, path
        assert leaf_at(view, path).dtype == jnp.bfloat16, path
    cast = sum(a.dtype != b.dtype for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(view)))
    assert cast == len(COMPUTE_DTYPE_LEAVES)
    assert leaf_at(view, ("model", "embed_tokens", "weight")).dtype == jnp.float32  # the lookup reads it in fp32


@pytest.mark.parametrize("ce_chunk", [None, 16], ids=["full_logits", "chunked_ce"])
def test_loss_and_gradients_at_the_view_equal_those_at_the_parameters(ce_chunk):
    cfg = bf16_config()
    graphdef, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=3), nnx.Param, BalancingBias)
    params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
    batch = {k: v[0] for k, v in stacked_batches(cfg, seed=1).items()}
    grad = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, False, ce_chunk_tokens=ce_chunk), has_aux=True))
    (loss, counts), want = grad(params, model_state, batch)
    (loss_v, counts_v), got = grad(compute_view(params, cfg.dtype), model_state, batch)
    np.testing.assert_array_equal(np.asarray(loss_v), np.asarray(loss))
    np.testing.assert_array_equal(np.asarray(counts_v), np.asarray(counts))
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=1e-6, atol=1e-9,
                                   err_msg=jax.tree_util.keystr(path[0]))


def accumulating_step(devices: int, compute_dtype):
    cfg = bf16_config()
    mesh = make_mesh(num_devices=devices)
    tx = build_optimizer(OPTIM, log=None)
    tx = tx if devices == 1 else zero1(tx, mesh)
    graphdef, state = init_state(cfg, tx, 0, lambda s: state_shardings(s, mesh, zero1=devices > 1))
    grad_fn = None
    if devices > 1:
        grad_fn = sharded_value_and_grad(make_local_loss_sums(graphdef, False), mesh, zero1_spec_fn(mesh))
    step = make_accumulating_train_step(graphdef, tx, BALANCER, grad_fn=grad_fn, compute_dtype=compute_dtype)
    batches = jax.device_put(stacked_batches(cfg), NamedSharding(mesh, P(None, "data")))
    compiled = jax.jit(step, out_shardings=(jax.tree.map(lambda x: x.sharding, state), NamedSharding(mesh, P()))
                       ).lower(state, batches).compile()
    return (compiled, step), state, batches


def casts_of(step, state, batches, shapes) -> list[bool]:
    """For each fp32 -> bf16 cast of an array of one of `shapes` in the step's jaxpr: whether it sits inside the
    microbatch loop (the step's top-level scan)."""
    found = []

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            if (eqn.primitive.name == "convert_element_type" and eqn.outvars[0].aval.dtype == jnp.bfloat16
                    and eqn.invars[0].aval.dtype == jnp.float32 and eqn.invars[0].aval.shape in shapes):
                found.append(inside)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub, inside or (jaxpr is top and eqn.primitive.name == "scan"))

    top = jax.make_jaxpr(step)(state, batches).jaxpr
    walk(top, False)
    return found


@pytest.mark.parametrize("devices", [1, 4], ids=["one_device", "zero1_4_devices"])
def test_the_accumulating_step_with_the_view_matches_the_step_without(devices):
    (with_view, step_view), state, batches = accumulating_step(devices, "bfloat16")
    (without, step_plain), _, _ = accumulating_step(devices, None)
    # the experts' weights ([E, out, in] per layer) are cast before the microbatch loop, not in it
    experts = {x.shape[1:] for x in jax.tree.leaves(leaf_at(state["params"], ("model", "layers", "mlp", "experts")))}
    assert any(casts_of(step_plain, state, batches, experts)), "control: without the view the loop casts them"
    view_casts = casts_of(step_view, state, batches, experts | {(2,) + s for s in experts})
    assert view_casts and not any(view_casts)
    got, got_metrics = jax.device_get(with_view(state, batches))
    want, want_metrics = jax.device_get(without(state, batches))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-6)

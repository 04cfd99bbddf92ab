"""Compute-dtype weights cast once per optimizer step (zaya_jax/model/compute_view.py):
  * every listed path names a leaf of the model's parameters (a stale path would silently cast nothing);
  * loss and gradients at the bf16 view equal those at the fp32 parameters (the cast's transpose upcasts the same
    bf16 cotangents), so the listed leaves have no fp32 use;
  * the per-layer view (unrolled layers) gives the same loss and, restacked, the same gradients;
  * the accumulating step with the view (stacked, or per layer for unrolled layers) gives the same new state as
    without it, on one device and through the trainer's shard_map gradients with ZeRO-1 on 4 emulated devices; it
    casts the experts' weights before the microbatch loop, not in it, and the per-layer view also slices them
    there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_train_accumulation import accumulating_setup, stacked_batches

from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.compute_view import COMPUTE_DTYPE_LEAVES, compute_view, tree_get
from zaya_jax.model.base import BalancingBias
from zaya_jax.model.layer_stack import LayerSlices, stack_layer_slices
from zaya_jax.train.step import make_loss_fn


def bf16_config(scan_layers=True):
    return preset("tiny", dtype="bfloat16", num_hidden_layers=2, remat="none", scan_layers=scan_layers)


def test_every_listed_leaf_exists_and_is_cast():
    cfg = bf16_config()
    _, params, _ = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=0)), nnx.Param, BalancingBias)
    params = nnx.to_pure_dict(params)
    view = jax.eval_shape(lambda p: compute_view(p, cfg.dtype), params)
    for path in COMPUTE_DTYPE_LEAVES:
        assert tree_get(params, path).dtype == jnp.float32, path
        assert tree_get(view, path).dtype == jnp.bfloat16, path
    cast = sum(a.dtype != b.dtype for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(view)))
    assert cast == len(COMPUTE_DTYPE_LEAVES)
    assert tree_get(view, ("model", "embed_tokens", "weight")).dtype == jnp.float32  # the lookup reads it in fp32


def assert_same_grads(got, want):
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=1e-6, atol=1e-9,
                                   err_msg=jax.tree_util.keystr(path[0]))


# the stacked view with full logits, the per-layer view with the trainer's chunked CE (the view does not touch the
# head): each CE path and each view once
@pytest.mark.parametrize("ce_chunk, per_layer", [(None, False), (16, True)],
                         ids=["full_logits", "chunked_ce_per_layer"])
def test_loss_and_gradients_at_the_view_equal_those_at_the_parameters(ce_chunk, per_layer):
    cfg = bf16_config(scan_layers=not per_layer)
    graphdef, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=3), nnx.Param, BalancingBias)
    params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
    batch = {k: v[0] for k, v in stacked_batches(cfg, seed=1).items()}
    grad = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, False, ce_chunk_tokens=ce_chunk), has_aux=True))
    (loss, counts), want = grad(params, model_state, batch)
    view = compute_view(params, cfg.dtype, per_layer=per_layer)
    if per_layer:
        experts = tree_get(view, ("model", "layers", "mlp", "experts", "down_proj"))
        assert isinstance(experts, LayerSlices) and len(experts.slices) == cfg.num_hidden_layers
        assert experts.dtype == jnp.bfloat16
    (loss_v, counts_v), got = grad(view, model_state, batch)
    np.testing.assert_array_equal(np.asarray(loss_v), np.asarray(loss))
    np.testing.assert_array_equal(np.asarray(counts_v), np.asarray(counts))
    assert jax.tree.structure(stack_layer_slices(got)) == jax.tree.structure(want)
    assert_same_grads(stack_layer_slices(got), want)


def test_a_per_layer_view_of_a_scanned_model_is_named():
    cfg = bf16_config(scan_layers=True)
    graphdef, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=3), nnx.Param, BalancingBias)
    params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
    batch = {k: v[0] for k, v in stacked_batches(cfg, seed=1).items()}
    with pytest.raises(ValueError, match="needs the layers unrolled"):
        make_loss_fn(graphdef, False)(compute_view(params, cfg.dtype, per_layer=True), model_state, batch)


def accumulating_step(devices: int, compute_dtype, *, unrolled: bool = False, per_layer: bool = False):
    """(the jitted step traced once: its jaxpr, and its lowering to compile), initial state, stacked batches."""
    cfg = bf16_config(scan_layers=not unrolled)
    _, state, step, mesh = accumulating_setup(cfg, devices, compute_dtype=compute_dtype, per_layer_view=per_layer)
    batches = jax.device_put(stacked_batches(cfg), NamedSharding(mesh, P(None, "data")))
    run = jax.jit(step, out_shardings=(jax.tree.map(lambda x: x.sharding, state), NamedSharding(mesh, P())))
    return run.trace(state, batches), state, batches


def ops_in(jaxpr, primitives, in_dtype, out_dtype, shapes) -> list[bool]:
    """For each equation of one of `primitives` in a step's jaxpr taking an `in_dtype` array of one of `shapes` to an
    `out_dtype` one: whether it sits inside the microbatch loop (the step's top-level scan)."""
    found = []

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            if (eqn.primitive.name in primitives and eqn.outvars[0].aval.dtype == out_dtype
                    and eqn.invars[0].aval.dtype == in_dtype and eqn.invars[0].aval.shape in shapes):
                found.append(inside)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub, inside or (jaxpr is top and eqn.primitive.name == "scan"))

    top = getattr(jaxpr, "jaxpr", jaxpr)
    walk(top, False)
    return found


def ops_on(step, state, batches, primitives, in_dtype, out_dtype, shapes) -> list[bool]:
    """ops_in of the step's jaxpr at (state, batches)."""
    return ops_in(jax.make_jaxpr(step)(state, batches), primitives, in_dtype, out_dtype, shapes)


SLICING = ("slice", "dynamic_slice", "gather", "squeeze")


# The per-layer view through the trainer's shard_map gradients. All three in the slow set (about 50 s each of
# compilation on 2 cores); by default the per-layer view runs in the accumulating step on one device
# (tests/test_train_accumulation.py) and is lowered in the ZeRO-1 context-parallel step (tests/test_unrolled_layers.py).
@pytest.mark.slow
@pytest.mark.parametrize("devices, per_layer", [pytest.param(1, False, id="one_device"),
                                                pytest.param(4, False, id="zero1_4_devices"),
                                                pytest.param(4, True, id="zero1_4_devices_per_layer")])
def test_the_accumulating_step_with_the_view_matches_the_step_without(devices, per_layer):
    step_view, state, batches = accumulating_step(devices, "bfloat16", unrolled=per_layer, per_layer=per_layer)
    step_plain, _, _ = accumulating_step(devices, None, unrolled=per_layer)
    # the experts' weights ([E, out, in] per layer) are cast before the microbatch loop, not in it
    experts = {x.shape for x in jax.tree.leaves(tree_get(state["params"], ("model", "layers", "mlp", "experts")))}
    layer_shapes = {s[1:] for s in experts}
    f32, bf16 = jnp.float32, jnp.bfloat16
    convert = ("convert_element_type",)
    assert any(ops_in(step_plain.jaxpr, convert, f32, bf16, layer_shapes)), "control: the loop casts them"
    view_casts = ops_in(step_view.jaxpr, convert, f32, bf16, experts | layer_shapes)
    assert view_casts and not any(view_casts)
    if per_layer:  # and sliced there: the loop never indexes stacked experts but for the accumulator's rows
        step_stacked, _, _ = accumulating_step(devices, "bfloat16", unrolled=True)
        assert any(ops_in(step_stacked.jaxpr, SLICING, bf16, bf16, experts)), "control: stacked view"
        assert not ops_in(step_view.jaxpr, SLICING, bf16, bf16, experts)
        assert not all(ops_in(step_view.jaxpr, SLICING, f32, f32, experts)), "sliced before the loop"
    got, got_metrics = jax.device_get(step_view.lower().compile()(state, batches))
    want, want_metrics = jax.device_get(step_plain.lower().compile()(state, batches))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-6)

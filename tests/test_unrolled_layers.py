"""The unrolled decoder (scan_layers=False, the GPU default) computes what the scanned one does, and the per-layer
slices' stacking VJP (zaya_jax/model/layer_stack.py) gives exactly the gradient of plain indexing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax.config import tiny
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.layer_stack import unstack_layers


def test_stacking_vjp_equals_indexing_vjp():
    keys = jax.random.split(jax.random.key(0), 3)
    tree = {"w": jax.random.normal(keys[0], (3, 4, 5)), "window": jnp.array([7, 9, 11], jnp.int32), "none": None}
    weights = jax.random.normal(keys[1], (3, 4, 5))

    def loss(w, unstack):
        layers = unstack({**tree, "w": w})
        # every layer's slice used twice, nonlinearly, and scaled by its (integer) window
        return sum(jnp.sum(jnp.sin(t["w"]) * weights[i] * t["window"] + t["w"] ** 2) for i, t in enumerate(layers))

    by_stack = jax.grad(loss)(tree["w"], lambda t: unstack_layers(t, 3))
    by_index = jax.grad(loss)(tree["w"], lambda t: [jax.tree.map(lambda a: a[i], t) for i in range(3)])
    np.testing.assert_array_equal(by_stack, by_index)
    assert unstack_layers(tree, 3)[2]["none"] is None and int(unstack_layers(tree, 3)[1]["window"]) == 9
    with pytest.raises(ValueError, match="leading layer axis of 4"):
        unstack_layers(tree, 4)


def test_unrolled_model_matches_scanned_model():
    kw = dict(dtype="float32", num_hidden_layers=3, remat="none", sliding_window=5,
              layer_types=("hybrid", "hybrid_sliding", "hybrid"))
    ids = jax.random.randint(jax.random.key(2), (2, 12), 3, 512)
    results = []
    for scan in (True, False):
        model = ZayaForCausalLM(tiny(scan_layers=scan, **kw), seed=4)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(ids)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (loss_scan, grads_scan), (loss_unrolled, grads_unrolled) = results
    np.testing.assert_allclose(loss_unrolled, loss_scan, rtol=1e-6)
    flat_scan, flat_unrolled = jax.tree.leaves(grads_scan), jax.tree.leaves(grads_unrolled)
    assert len(flat_scan) == len(flat_unrolled)
    for a, b in zip(flat_unrolled, flat_scan):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


def test_unrolled_model_lowers_in_the_zero1_context_parallel_step():
    """shard_map's type checks (check_vma) accept the stacking VJP: the trainer's ZeRO-1 step with context
    parallelism 2 (ring attention) over 8 devices lowers with the layers unrolled (traced and lowered, not
    compiled: the numerics are the single-device test's)."""
    from ml_collections import ConfigDict
    from test_train import small_config

    from zaya_jax.optim.balancing import BalancerConfig
    from zaya_jax.parallel.context import ContextParallel
    from zaya_jax.parallel.data_parallel import sharded_value_and_grad
    from zaya_jax.parallel.sharding import zero1_spec_fn
    from zaya_jax.parallel.zigzag import Zigzag
    from zaya_jax.train.loop import setup
    from zaya_jax.train.step import make_local_loss_sums, make_train_step

    c = small_config()
    c.model.overrides["scan_layers"] = False
    c.mesh.num_devices, c.mesh.context = 8, 2
    c.parallel = ConfigDict(dict(zero1=True, context_attention="ring"))
    s = setup(c, log=lambda *_: None)
    assert not s.plan.model.scan_layers
    cp = ContextParallel(Zigzag(2, s.plan.seq_len), attention="ring", impl=s.plan.model.attention_impl)
    grad_fn = sharded_value_and_grad(make_local_loss_sums(s.graphdef, False, cp), s.mesh, zero1_spec_fn(s.mesh),
                                     zigzag=cp.zigzag)
    step = make_train_step(s.graphdef, s.tx, BalancerConfig(**dict(c.balancing)), grad_fn=grad_fn)
    rows, seq = s.plan.micro_rows, s.plan.seq_len
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("inputs", "targets", "loss_mask")}
    batch["source_ids"] = jax.ShapeDtypeStruct((rows,), jnp.int32)
    text = jax.jit(step).lower(s.state, batch).as_text()
    assert "collective_permute" in text  # the ring's K/V exchange is there

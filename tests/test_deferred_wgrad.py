"""Expert weight gradients deferred to the end of an accumulation pass (zaya_jax/model/deferred_wgrad.py) and the
embedding lookup's gradient taken out as rows (zaya_jax/model/embedding_tap.py):
  * at a deferred, tapped view, one microbatch's gradients of every other leaf are exactly those at the plain
    per-layer view, the embedding table's (head GEMM, then the rows scattered) equal its gradient to fp32 rounding,
    and the experts' gradients formed from the taps equal theirs (fp32: to rounding; bf16: to the compute dtype's
    rounding of the plain path, which the deferred sum does not do);
  * the accumulating step with deferral (k = 4 microbatches, 2 per pass, the Pallas grouped GEMM in interpret mode,
    the chunked head loss) gives the same new state as without it (both tapped: the step always taps);
  * the tapped step's tied head reads the table cast to the compute dtype once per step, not once per pass;
  * configurations it cannot serve are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_compute_view import ops_on
from test_train_accumulation import OFF, OPTIM, accumulating_setup, stacked_batches

from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model import deferred_wgrad, embedding_tap
from zaya_jax.model.base import BalancingBias
from zaya_jax.model.compute_view import compute_view
from zaya_jax.model.layer_stack import stack_layer_slices
from zaya_jax.ops import grouped_matmul as gmm
from zaya_jax.optim.optimizer import build_optimizer
from zaya_jax.train.step import make_accumulating_train_step, make_loss_fn


def config(dtype: str, moe_impl: str = "pallas"):
    return preset("tiny", dtype=dtype, num_hidden_layers=2, remat="none", scan_layers=False, moe_impl=moe_impl)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def leaves_by_path(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# fp32 in the slow set with the accumulating step's test below (which holds the deferred expert gradients to 1e-5
# in fp32); bf16 (the training dtype) checks the same exact non-expert gradients and embedding rows here
@pytest.mark.parametrize("dtype, expert_tol", [pytest.param("float32", 1e-5, marks=pytest.mark.slow),
                                               ("bfloat16", 1e-2)])
def test_one_microbatch_gradients_at_the_deferred_view(dtype, expert_tol):
    cfg = config(dtype)
    graphdef, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=3), nnx.Param, BalancingBias)
    params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
    batch = {k: v[0] for k, v in stacked_batches(cfg, seed=1).items()}
    grad = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, False), has_aux=True))
    view = compute_view(params, cfg.dtype, per_layer=True)
    (loss, _), want = grad(view, model_state, batch)
    tokens = batch["inputs"].size
    deferred = deferred_wgrad.defer_expert_wgrads(view, tokens, gmm.block_rows(jnp.dtype(cfg.dtype)))
    (loss_d, _), got = grad(embedding_tap.tap(deferred, batch["inputs"].shape), model_state, batch)
    np.testing.assert_array_equal(np.asarray(loss_d), np.asarray(loss))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), view)

    def accumulate(z, g):
        g, rows = embedding_tap.split(g)
        z = deferred_wgrad.accumulate(z, [g], lambda t, x: t + x.astype(jnp.float32), impl="pallas")
        return embedding_tap.add_rows(z, [rows], [batch["inputs"]])

    total = jax.jit(accumulate)(zeros, got)
    want = {k: np.asarray(v, np.float32) for k, v in leaves_by_path(stack_layer_slices(want)).items()}
    got = leaves_by_path(stack_layer_slices(total))
    assert got.keys() == want.keys()
    experts = [k for k in got if "'experts'" in k]
    assert len(experts) == 2
    embedding = "['model']['embed_tokens']['weight']"
    for k in got:
        if k in experts:
            assert rel(got[k], want[k]) <= expert_tol, k
        elif k == embedding:
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-6, atol=1e-9)
        else:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


@pytest.mark.slow  # one microbatch at the deferred view by default (above)
def test_the_accumulating_step_with_deferral_matches_the_step_without():
    cfg = config("float32")
    kwargs = dict(compute_dtype="float32", per_layer_view=True, grads_per_pass=2, ce_chunk_tokens=16)
    _, state, deferred, _ = accumulating_setup(cfg, 1, defer_expert_wgrad=True, **kwargs)
    _, _, plain, _ = accumulating_setup(cfg, 1, **kwargs)
    batches = stacked_batches(cfg, k=4)
    got, got_metrics = jax.device_get(jax.jit(deferred)(state, batches))
    want, want_metrics = jax.device_get(jax.jit(plain)(state, batches))
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path[0]))
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)


def test_the_tapped_step_casts_the_tied_head_once_per_step():
    cfg = config("bfloat16")
    table = {(cfg.vocab_size, cfg.hidden_size)}
    f32, bf16, convert = jnp.float32, jnp.bfloat16, ("convert_element_type",)
    _, state, step, _ = accumulating_setup(cfg, 1, compute_dtype="bfloat16", per_layer_view=True,
                                           ce_chunk_tokens=16)
    casts = ops_on(step, state, stacked_batches(cfg, k=2), convert, f32, bf16, table)
    assert casts and not any(casts), casts  # cast before the loop, none inside it


def abstract_model(cfg):
    """(graphdef, params, model_state) of the model as shapes: the refusals below come while tracing."""
    graphdef, params, model_state = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=3)), nnx.Param,
                                              BalancingBias)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)


def test_configurations_deferral_cannot_serve_are_named():
    cfg = config("float32")
    graphdef, _, _ = abstract_model(cfg)
    with pytest.raises(ValueError, match="per-layer view"):
        make_accumulating_train_step(graphdef, build_optimizer(OPTIM, log=None), OFF, balance_tokens=False,
                                     defer_expert_wgrad=True, compute_dtype="float32")
    cfg = config("float32", moe_impl="ragged")
    graphdef, params, model_state = abstract_model(cfg)
    batch = {k: v[0] for k, v in stacked_batches(cfg, seed=1).items()}

    def loss_at_the_deferred_view(params, model_state, batch):
        view = deferred_wgrad.defer_expert_wgrads(compute_view(params, cfg.dtype, per_layer=True),
                                                  batch["inputs"].size, 16)
        return make_loss_fn(graphdef, False)(view, model_state, batch)

    with pytest.raises(ValueError, match="moe_impl 'pallas'"):
        jax.eval_shape(loss_at_the_deferred_view, params, model_state, batch)

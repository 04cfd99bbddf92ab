"""The training benchmark (zaya_jax/train/bench.py) on the CPU: the bf16-cotangent backward GEMMs it measures give
the gradients of the unpatched model, and one variant runs end to end and writes its report."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.train import bench
from zaya_jax.train.step import make_loss_fn


import pytest


@pytest.mark.parametrize("bf16_out", [False, True])
def test_bf16_cotangent_gemms_keep_the_gradients(bf16_out):
    cfg = preset("tiny", remat="none", dtype="bfloat16")
    graphdef, params, state = nnx.split(ZayaForCausalLM(cfg, seed=0), nnx.Param, BalancingBias)
    params, state = nnx.to_pure_dict(params), nnx.to_pure_dict(state)
    B, T = 2, 32
    ids = jax.random.randint(jax.random.key(1), (B, T + 1), 3, cfg.vocab_size)
    batch = dict(inputs=ids[:, :-1], targets=ids[:, 1:], loss_mask=jnp.ones((B, T)),
                 source_ids=jnp.zeros((B,), jnp.int32))
    grad = jax.value_and_grad(make_loss_fn(graphdef, False), has_aux=True)
    (l0, c0), g0 = jax.jit(grad)(params, state, batch)
    with bench.bf16_backward_gemms(bf16_out)():
        (l1, c1), g1 = jax.jit(grad)(params, state, batch)
    if bf16_out:  # one rounding of the same fp32-accumulated products (CPU accumulation order may differ)
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-3)
    else:
        assert float(l1) == float(l0)  # the forward is untouched
    if not bf16_out:
        np.testing.assert_array_equal(c1, c0)
    for path, a in jax.tree_util.tree_leaves_with_path(g1):
        b = g0
        for k in path:
            b = b[k.key]
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # the same bf16-valued products, fp32 accumulation in another order: bf16 rounding of the results at most
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b) + 1e-12, jax.tree_util.keystr(path)


def test_bench_runs_one_variant_on_cpu(tmp_path):
    out = tmp_path / "report.json"
    args = bench.parse_args(["--preset", "tiny", "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
                             "--variants", "main,opt_zaya", "--no-hf", "--ce-chunk", "24", "--compile-threads", "2",
                             "--workdir", str(tmp_path / "w"), "--out", str(out)])
    rep = bench.run(args)
    assert rep["errors"] == {}
    main = rep["variants"]["main"]
    assert main["loss_finite"] and main["tokens_per_s"] > 0 and main["steps_timed"] == 2
    assert 0 < rep["breakdown"]["optimizer_share"]
    assert json.loads(out.read_text())["tokens_per_s"] == rep["tokens_per_s"]

"""Checks the memory model against what jax and XLA actually allocate for this code base's training step:
  traced    bytes of the residuals jax saves for the backward (jaxpr level, exact for model/; no compiler), from
            jax.ad_checkpoint.print_saved_residuals over the forward pass with abstract inputs;
  compiled  XLA's buffer assignment for the whole jitted train step (compiled.memory_analysis(): arguments,
            outputs, aliasing, temporaries), on whatever backend runs this (the CPU in tests, a GPU in the suite).
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.config import ModelConfig
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.model.loss import token_cross_entropy_terms
from zaya_jax.optim.balancing import BalancerConfig
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from benchmarks.systems import memory_model as mm
from zaya_jax.train.loop import init_state
from zaya_jax.train.step import make_train_step

_RESIDUAL = re.compile(r"^\s*(\w+)\[([\d,\s]*)\]\s+(.*)$")
_BITS = re.compile(r"[a-z]+(\d+)$")


def _itemsize(short_dtype: str) -> int:
    """'f32' -> 4, 'bf16' -> 2, 'bool' -> 1 (jaxpr's short names)."""
    m = _BITS.match(short_dtype)
    return int(m.group(1)) // 8 if m else 1


def traced_activation_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Bytes of everything the forward pass and the loss save for the backward, parameters excluded."""
    abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=0))
    graphdef, params, model_state = nnx.split(abstract, nnx.Param, BalancingBias)
    params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)

    def loss(params, ids):
        logits, _ = nnx.merge(graphdef, params, model_state).forward(ids)
        terms, _ = token_cross_entropy_terms(logits, ids, jnp.ones(ids.shape, jnp.float32))
        return terms.sum()

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, params, jax.ShapeDtypeStruct((batch, seq_len), jnp.int32))
    total = 0.0
    for line in out.getvalue().splitlines():
        m = _RESIDUAL.match(line)
        if m is None or "from the argument" in m.group(3):
            continue
        dims = [int(v) for v in m.group(2).replace(" ", "").split(",") if v]
        total += math.prod(dims) * _itemsize(m.group(1))
    return total


def _synthetic_batch(batch: int, seq_len: int, vocab: int) -> dict:
    ids = (jnp.arange(batch * seq_len, dtype=jnp.int32).reshape(batch, seq_len) * 7919) % vocab
    return dict(inputs=ids, targets=jnp.roll(ids, -1, axis=1), loss_mask=jnp.ones((batch, seq_len), jnp.float32),
                source_ids=jnp.zeros((batch,), jnp.int32), positions=jnp.tile(jnp.arange(seq_len), (batch, 1)),
                segment_ids=jnp.ones((batch, seq_len), jnp.int32))


def compiled_step_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> dict:
    """XLA's allocation for one jitted train step on one device (state donated, as the trainer runs it)."""
    tx = build_optimizer(OptimizerConfig(warmup_steps=10, total_steps=100), None, log=None)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    graphdef, state = init_state(cfg, tx, 0, NamedSharding(mesh, P()))
    step = jax.jit(make_train_step(graphdef, tx, BalancerConfig()), donate_argnums=0)
    ma = step.lower(state, _synthetic_batch(batch, seq_len, cfg.vocab_size)).compile().memory_analysis()
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes)
    return dict(arguments=ma.argument_size_in_bytes, outputs=ma.output_size_in_bytes,
                aliased=ma.alias_size_in_bytes, temporaries=ma.temp_size_in_bytes, peak=peak,
                state=sum(x.nbytes for x in jax.tree.leaves(state)))


def validate(cfg: ModelConfig, batch: int, seq_len: int, compile_step: bool = True) -> dict:
    """The model's prediction for this trainer (recipe zaya_jax, one device) next to the traced and compiled
    figures."""
    recipe = mm.zaya_jax_recipe(cfg)
    predicted = mm.step_memory(cfg, recipe, mm.Parallel(), seq_len, batch)
    tokens = batch * seq_len
    model_saved = (predicted["layers"] + predicted["logits"] / 2 + predicted["embedding"]
                   + predicted.get("compute_weight_copies", 0.0)) / tokens
    out = dict(batch=batch, seq_len=seq_len, remat=cfg.remat, dtype=cfg.dtype, predicted=predicted,
               predicted_saved_per_token=model_saved)
    if cfg.remat in ("none", "save_dots"):  # with remat the traced residuals are only the layer inputs
        traced = traced_activation_bytes(cfg, batch, seq_len) / tokens
        out.update(traced_saved_per_token=traced, saved_ratio=model_saved / traced)
    if compile_step:
        compiled = compiled_step_bytes(cfg, batch, seq_len)
        out.update(compiled=compiled, peak_ratio=predicted["total"] / compiled["peak"])
    return out

"""The programs the training benchmark compiles: model config, optimizer, synthetic batches, the train state as the
trainer builds it, and the jitted function of each variant kind (benchmarks/training/bench_variants.py). Kind
'accum' is the trainer's own program (zaya_jax/train/program.py build_train_program) from a config of the variant."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict

from configs.default import get_config
from pallas_kernels import grouped_matmul as grouped_kernels
from zaya_jax.config import preset
from zaya_jax.optim.balancing import BalancerConfig
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from benchmarks.training.bench_variants import Variant
from zaya_jax.train.program import build_train_program, graphdef_of, state_creator
from zaya_jax.train.step import make_loss_fn, make_train_step


def model_config(preset_name: str, v: Variant, dtype: str):
    """The preset with the variant's overrides; an override the config rejects (e.g. a moe_impl another change has
    not landed yet) raises the config's own error, reported for that variant only."""
    return preset(preset_name, attention_impl=v.attention_impl, remat=v.remat, moe_impl=v.moe_impl,
                  norm_impl=v.norm_impl, ce_impl=v.ce_impl, conv_impl=v.conv_impl, dtype=dtype,
                  scan_layers=v.scan_layers)


def make_tx(v: Variant) -> optax.GradientTransformation:
    if v.optimizer == "adamw":  # HF's optimizer: torch AdamW (0.9, 0.95, wd 0.1) on every parameter, clipped
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    return build_optimizer(zaya_optimizer(v), log=None)


def zaya_optimizer(v: Variant) -> OptimizerConfig:
    return OptimizerConfig(warmup_steps=10, total_steps=1000, muon_gram_impl=v.muon_gram_impl)


def make_batch(cfg, batch: int, seq: int, seed: int = 0, accum: int = 0) -> dict:
    """Random tokens; accum > 0 stacks that many microbatches on a leading axis (the accumulating step's input)."""
    lead = (accum,) if accum else ()
    ids = jax.random.randint(jax.random.key(seed), lead + (batch, seq + 1), 3, cfg.vocab_size, dtype=jnp.int32)
    return {"inputs": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": jnp.ones(lead + (batch, seq), jnp.float32),
            "source_ids": jnp.zeros(lead + (batch,), jnp.int32)}


def variant_batch(cfg, v: Variant, seed: int = 0) -> dict:
    return make_batch(cfg, v.batch, v.seq, seed, accum=v.accum if v.kind == "accum" else 0)


def graphdef_for(cfg):
    return graphdef_of(cfg, 0)


def make_state_creator(cfg, tx, seed: int = 0):
    """The train state exactly as zaya_jax.train.program builds it (one device, no sharding)."""
    return state_creator(cfg, tx, seed)


def train_config(preset_name: str, v: Variant, dtype: str) -> ConfigDict:
    """The trainer's config of an 'accum' variant: configs/default.py with the variant's model, one device,
    v.accum microbatches of v.batch x v.seq per optimizer step and its step options (train.*)."""
    c = get_config()
    c.seed = 0
    c.model = ConfigDict(dict(preset=preset_name, overrides=ConfigDict(dict(
        attention_impl=v.attention_impl, remat=v.remat, moe_impl=v.moe_impl, norm_impl=v.norm_impl, ce_impl=v.ce_impl,
        conv_impl=v.conv_impl, dtype=dtype, scan_layers=v.scan_layers))))
    c.data.seq_len = v.seq
    c.train.update(steps=1, microbatch_tokens=v.batch * v.seq, global_batch_tokens=v.accum * v.batch * v.seq,
                   ce_chunk_tokens=v.ce_chunk or 0, cast_weights_once=v.cast_weights_once,
                   grads_per_pass=v.grads_per_pass, defer_expert_wgrad=v.defer_expert_wgrad)
    c.train.per_layer_view = v.per_layer_view
    c.optim = ConfigDict(dataclasses.asdict(zaya_optimizer(v)))  # what make_tx builds (its tx is passed as given)
    c.balancing = ConfigDict(dataclasses.asdict(BalancerConfig()))
    c.mesh = ConfigDict(dict(data=-1, context=1, num_devices=1))
    return c


def build_fn(v: Variant, cfg, tx, preset_name: str | None = None, dtype: str | None = None):
    """The jitted program of a variant ('accum' needs preset_name and dtype: the trainer's program is built from its
    config, with `tx` as its optimizer). Call signatures: step/accum (state, batch) -> (state, metrics), state
    donated; fwd/fwd_bwd (state, batch) -> outputs; opt (params, opt_state, grads) -> (params, opt_state)."""
    graphdef = graphdef_for(cfg)
    balancer = BalancerConfig()
    if v.kind == "step":
        return jax.jit(make_train_step(graphdef, tx, balancer, ce_chunk_tokens=v.ce_chunk), donate_argnums=0)
    if v.kind == "accum":  # the trainer's program on one device: k microbatches scanned in one program, one update
        return build_train_program(train_config(preset_name, v, dtype), log=None, init=False, tx=tx).step
    loss_fn = make_loss_fn(graphdef, False, ce_chunk_tokens=v.ce_chunk)
    if v.kind == "fwd":
        return jax.jit(lambda state, batch: loss_fn(state["params"], state["model_state"], batch)[0])
    if v.kind == "fwd_bwd":
        return jax.jit(lambda state, batch: jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["model_state"], batch))
    if v.kind == "opt":
        def opt(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        return jax.jit(opt, donate_argnums=(0, 1))
    raise ValueError(f"variant {v.name}: no program for kind {v.kind!r}")


def lower(v: Variant, preset_name: str, dtype: str, state_shapes_for) -> dict:
    """Trace and lower a variant (no compile): {cfg, tx, lowered}. state_shapes_for(v, cfg, tx) -> the abstract
    state of the variant's state key (shared so that equal keys build one state)."""
    cfg = model_config(preset_name, v, dtype)
    tx = make_tx(v)
    fn = build_fn(v, cfg, tx, preset_name, dtype)
    state = state_shapes_for(v, cfg, tx)
    with grouped_kernels.tiling_override(**dict(v.moe_tiling)):
        if v.kind == "opt":
            lowered = fn.lower(state["params"], state["opt_state"], state["params"])
        else:
            lowered = fn.lower(state, jax.eval_shape(lambda: variant_batch(cfg, v)))
    return {"cfg": cfg, "tx": tx, "lowered": lowered}

"""The programs the training benchmark compiles: model config, optimizer, synthetic batches, the train state as the
trainer builds it, and the jitted function of each variant kind (zaya_jax/train/bench_variants.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.optim.balancing import BalancerConfig, init_balancer, update_biases
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from zaya_jax.train.bench_variants import Variant
from zaya_jax.train.step import get_biases, make_loss_fn, make_train_step, with_biases


def model_config(preset_name: str, v: Variant, dtype: str):
    """The preset with the variant's overrides; an override the config rejects (e.g. a moe_impl another change has
    not landed yet) raises the config's own error, reported for that variant only."""
    return preset(preset_name, attention_impl=v.attention_impl, remat=v.remat, moe_impl=v.moe_impl,
                  norm_impl=v.norm_impl, dtype=dtype, scan_layers=v.scan_layers)


def make_tx(v: Variant) -> optax.GradientTransformation:
    if v.optimizer == "adamw":  # HF's optimizer: torch AdamW (0.9, 0.95, wd 0.1) on every parameter, clipped
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    k = v.accum if v.kind == "accum" and v.accum_update == "trainer" else 1
    return build_optimizer(OptimizerConfig(warmup_steps=10, total_steps=1000, muon_gram_impl=v.muon_gram_impl,
                                           accumulation_steps=k), log=None)


def make_batch(cfg, batch: int, seq: int, seed: int = 0, accum: int = 0) -> dict:
    """Random tokens; accum > 0 stacks that many microbatches on a leading axis (the scanned programs)."""
    lead = (accum,) if accum else ()
    ids = jax.random.randint(jax.random.key(seed), lead + (batch, seq + 1), 3, cfg.vocab_size, dtype=jnp.int32)
    return {"inputs": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": jnp.ones(lead + (batch, seq), jnp.float32),
            "source_ids": jnp.zeros(lead + (batch,), jnp.int32)}


def variant_batch(cfg, v: Variant, seed: int = 0) -> dict:
    return make_batch(cfg, v.batch, v.seq, seed, accum=v.accum if v.kind == "accum" else 0)


def graphdef_for(cfg):
    abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=0))
    return nnx.split(abstract, nnx.Param, BalancingBias)[0]


def make_state_creator(cfg, tx, seed: int = 0):
    """The train state exactly as zaya_jax.train.loop.init_state builds it (one device, no sharding)."""

    def create():
        _, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=seed), nnx.Param, BalancingBias)
        params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                "model_state": model_state, "balancer": init_balancer(cfg.num_hidden_layers, cfg.num_experts)}

    return create


def accumulate_then_update(graphdef, tx, balancer: BalancerConfig, ce_chunk: int | None):
    """k microbatches (batches stacked on axis 0) as one program: forward + backward per microbatch, gradients summed
    in fp32, the balancing controller once per microbatch (as the trainer does), then ONE optimizer update with the
    mean gradient (what accumulate.every_k applies every k calls)."""
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, False, ce_chunk_tokens=ce_chunk), has_aux=True)

    def program(state, batches):
        params = state["params"]
        k = jax.tree.leaves(batches)[0].shape[0]

        def micro(carry, batch):
            acc, model_state, balancer_state = carry
            (loss, counts), grads = grad_fn(params, model_state, batch)
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
            biases, balancer_state, _ = update_biases(get_biases(model_state), balancer_state, counts, balancer)
            return (acc, with_biases(model_state, biases), balancer_state), loss

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (acc, model_state, balancer_state), losses = jax.lax.scan(
            micro, (zeros, state["model_state"], state["balancer"]), batches)
        grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + k, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state, "model_state": model_state, "balancer": balancer_state}
        return new_state, {"loss": losses[-1]}

    return program


def build_fn(v: Variant, cfg, tx):
    """The jitted program of a variant. Call signatures: step/accum (state, batch) -> (state, metrics), state
    donated; fwd/fwd_bwd (state, batch) -> outputs; opt (params, opt_state, grads) -> (params, opt_state)."""
    graphdef = graphdef_for(cfg)
    balancer = BalancerConfig()
    if v.kind == "step":
        return jax.jit(make_train_step(graphdef, tx, balancer, ce_chunk_tokens=v.ce_chunk), donate_argnums=0)
    if v.kind == "accum":
        if v.accum_update == "once":
            return jax.jit(accumulate_then_update(graphdef, tx, balancer, v.ce_chunk), donate_argnums=0)
        step = make_train_step(graphdef, tx, balancer, ce_chunk_tokens=v.ce_chunk)

        def trainer_accumulation(state, batches):  # the trainer calls step once per microbatch; here a scan
            state, metrics = jax.lax.scan(step, state, batches)
            return state, {"loss": metrics["loss"][-1]}

        return jax.jit(trainer_accumulation, donate_argnums=0)
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
    fn = build_fn(v, cfg, tx)
    state = state_shapes_for(v, cfg, tx)
    if v.kind == "opt":
        lowered = fn.lower(state["params"], state["opt_state"], state["params"])
    else:
        lowered = fn.lower(state, jax.eval_shape(lambda: variant_batch(cfg, v)))
    return {"cfg": cfg, "tx": tx, "lowered": lowered}

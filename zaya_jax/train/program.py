"""The train program: mesh, model, optimizer, train state and the sharded, jitted train step, assembled from a run's
config in one place. The trainer (train/loop.py) runs it; the benchmarks (benchmarks/training/bench_programs.py,
benchmarks/systems/scaling_step.py) compile it, so they measure the program the trainer runs."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from zaya_jax.checkpoint.manager import abstract_like
from zaya_jax.config import ModelConfig, preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.model_info import describe
from zaya_jax.optim.balancing import BalancerConfig, init_balancer
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from zaya_jax.parallel.config import ParallelConfig
from zaya_jax.parallel.context import ContextParallel
from zaya_jax.parallel.data_parallel import sharded_value_and_grad
from zaya_jax.parallel.mesh import describe_mesh, make_mesh
from zaya_jax.parallel.sharding import (combine_threshold_options, describe_optimizer_memory, state_shardings, zero1,
                                         zero1_spec_fn, zero_axes)
from zaya_jax.parallel.zigzag import Zigzag
from zaya_jax.train.errors import TrainConfigError
from zaya_jax.train.step import make_accumulating_train_step, make_local_loss_sums


@dataclasses.dataclass
class Plan:
    """Sizes derived from the config, validated once."""

    model: ModelConfig
    seq_len: int
    micro_rows: int  # sequences per microbatch, global
    accumulation: int  # microbatches per optimizer step (after any batch ramp)
    steps: int  # optimizer steps
    ramp: tuple[int, ...] = ()  # microbatches of the first optimizer steps while the batch ramps up

    def accumulation_at(self, step: int) -> int:
        return self.ramp[step] if step < len(self.ramp) else self.accumulation


def validate(config: ConfigDict) -> None:
    """Refuses values that cannot work, before any model is built or compiled."""
    t, o = config.train, config.optim
    positive = {"data.seq_len": config.data.seq_len, "train.steps": t.steps, "train.log_every": t.log_every,
                "train.checkpoint_every": t.checkpoint_every, "train.global_batch_tokens": t.global_batch_tokens,
                "train.microbatch_tokens": t.microbatch_tokens}
    for name, v in positive.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise TrainConfigError(f"{name}={v!r} must be a positive whole number")
    if t.get("eval_every") is not None and t.eval_every < 0:
        raise TrainConfigError(f"train.eval_every={t.eval_every} must be >= 0 (0: no evaluation)")
    for name, what in (("eval_batches", "every held-out batch"), ("keep_checkpoints", "keep all")):
        if t.get(name) is not None and t[name] < 1:
            raise TrainConfigError(f"train.{name}={t[name]} must be >= 1 (or None: {what})")
    lr = o.get("learning_rate")
    if not isinstance(lr, (int, float)) or not 0 <= lr < math.inf:
        raise TrainConfigError(f"optim.learning_rate={lr!r} must be a finite number >= 0")


def make_plan(config: ConfigDict) -> Plan:
    validate(config)
    cfg = preset(config.model.preset, **dict(config.model.get("overrides", {})))
    t, seq = config.train, config.data.seq_len
    for name in ("global_batch_tokens", "microbatch_tokens"):
        if t[name] % seq:
            raise TrainConfigError(f"train.{name}={t[name]} is not a multiple of data.seq_len={seq}")
    if t.global_batch_tokens % t.microbatch_tokens:
        raise TrainConfigError(f"train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                               f"train.microbatch_tokens={t.microbatch_tokens}")
    if int(t.get("grads_per_pass", 1)) < 1:
        raise TrainConfigError(f"train.grads_per_pass={t.grads_per_pass} must be >= 1 (microbatch gradients added to "
                               "the fp32 sum in one pass)")
    accumulation = t.global_batch_tokens // t.microbatch_tokens
    return Plan(cfg, seq, t.microbatch_tokens // seq, accumulation, t.steps,
                batch_ramp(t.get("batch_ramp", {}), t.microbatch_tokens, accumulation))


def batch_ramp(ramp, microbatch_tokens: int, accumulation: int) -> tuple[int, ...]:
    """Microbatches per step while the global batch grows linearly, in tokens, from `start_tokens` to the full
    batch over the first `ramp_tokens` tokens trained (rounded up to whole microbatches)."""
    start, span = int(ramp.get("start_tokens", 0)), int(ramp.get("ramp_tokens", 0))
    if not span:
        return ()
    if not 0 < start <= accumulation * microbatch_tokens:
        raise TrainConfigError(f"train.batch_ramp.start_tokens={start} must be in (0, global_batch_tokens]")
    ks, seen = [], 0
    while seen < span:
        want = start + (accumulation * microbatch_tokens - start) * seen / span
        k = min(accumulation, max(1, -(-int(want) // microbatch_tokens)))
        ks.append(k)
        seen += k * microbatch_tokens
    return tuple(ks)


def graphdef_of(cfg: ModelConfig, seed: int = 0):
    """The model's graph definition (no parameters allocated)."""
    abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=seed))
    return nnx.split(abstract, nnx.Param, BalancingBias)[0]


def state_creator(cfg: ModelConfig, tx, seed: int):
    """create() -> the train state: step, parameters, optimizer state, model state (balancing biases), balancer."""

    def create():
        _, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=seed), nnx.Param, BalancingBias)
        params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                "model_state": model_state, "balancer": init_balancer(cfg.num_hidden_layers, cfg.num_experts)}

    return create


def init_state(cfg: ModelConfig, tx, seed: int, sharding):
    """Parameters, model state and optimizer state, created directly with their shardings (no host copy).
    sharding: one NamedSharding for every leaf, or a function of the state's shapes -> shardings (ZeRO-1)."""
    create = state_creator(cfg, tx, seed)
    shapes = jax.eval_shape(create)
    shardings = sharding(shapes) if callable(sharding) else jax.tree.map(lambda _: sharding, shapes)
    return graphdef_of(cfg, seed), jax.jit(create, out_shardings=shardings)()


def optimizer_config(config: ConfigDict) -> OptimizerConfig:
    """The schedule follows the run: optim.total_steps 0 (or unset) means train.steps; one shorter than
    train.steps is refused (its last steps would train at learning rate 0)."""
    o = dict(config.optim)
    total, steps = int(o.get("total_steps") or 0), int(config.train.steps)
    if total <= 0:
        o["total_steps"] = steps
    elif total < steps:
        raise TrainConfigError(f"train.steps={steps} runs past optim.total_steps={total} (learning rate 0 after it): "
                               f"set --config.optim.total_steps={steps}, or 0 to follow train.steps")
    if o.get("schedule", "wsd") != "constant" and int(o.get("warmup_steps", 0)) > o["total_steps"]:
        raise TrainConfigError(f"optim.warmup_steps={o['warmup_steps']} is longer than the schedule "
                               f"({o['total_steps']} steps): lower --config.optim.warmup_steps")
    return OptimizerConfig(**o)


@dataclasses.dataclass
class TrainProgram:
    """What build_train_program assembles. step(state, batches) -> (state, metrics): one optimizer step over the
    stacked microbatches of `batches` (every field [k, rows, ...], laid out as batch_sharding), the state donated
    and returned with `shardings`; metrics replicated."""

    plan: Plan
    mesh: object
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    tx: object
    graphdef: object
    shardings: object  # the state's NamedShardings (a tree like the state)
    abstract_state: object  # the state's shapes, dtypes and shardings (jax.ShapeDtypeStruct leaves)
    create: Callable[[], dict]  # the state's creator (unsharded); init_state() creates it sharded
    step: object  # the jitted train step
    batch_sharding: NamedSharding  # [k, rows, ...]: every device holds its rows of all k microbatches
    state: dict | None = None  # the initial state (None when built with init=False)

    @property
    def model(self) -> ModelConfig:
        return self.plan.model

    def init_state(self) -> dict:
        """The initial train state, created directly with its shardings."""
        return jax.jit(self.create, out_shardings=self.shardings)()


def build_train_program(config: ConfigDict, *, log=print, init: bool = True, tx=None) -> TrainProgram:
    """The trainer's program from its config: mesh, model, optimizer (ZeRO-1 when parallel.zero1), train state and
    jitted step. init=False: no state is created (compile from abstract_state first, then init_state()).
    tx: an optimizer to use instead of the one config.optim builds (still wrapped for ZeRO-1) -- benchmarks'
    optimizer variants."""
    log = log or (lambda *_: None)
    plan = make_plan(config)
    cfg = plan.model
    mesh_args = dict(config.mesh)
    if os.environ.get("ZAYA_NUM_DEVICES"):  # set by the supervisor when it restarts on fewer devices
        mesh_args["num_devices"] = int(os.environ["ZAYA_NUM_DEVICES"])
    mesh = make_mesh(**mesh_args)
    if cfg.attention_impl == "cudnn" and mesh.devices.size > 1:
        # cuDNN's custom call needs one mesh for the whole program, but the per-device gradients run on the
        # hierarchical (node, data_local) view of it: JAX refuses the mix at lowering
        raise TrainConfigError("model attention_impl='cudnn' runs on one device only; on several devices use "
                               "attention_impl='pallas' (the portable flash kernel) or 'xla'")
    log(describe(cfg))
    log(describe_mesh(mesh))
    ocfg = optimizer_config(config)
    if tx is None:
        tx = build_optimizer(ocfg, None, log=None)
    par = ParallelConfig.from_config(config)
    if par.zero1:  # optimizer state sharded over the batch axes (parallel/sharding.py); a no-op on one device
        tx = zero1(tx, mesh, muon=par.muon_placement)
    graphdef = graphdef_of(cfg, config.seed)
    create = state_creator(cfg, tx, config.seed)
    shapes = jax.eval_shape(create)
    shardings = state_shardings(shapes, mesh, zero1=par.zero1)
    abstract = abstract_like(shapes, shardings)
    state = jax.jit(create, out_shardings=shardings)() if init else None
    log(describe_optimizer_memory(state["opt_state"] if init else abstract["opt_state"], mesh))
    step = _train_step(config, plan, mesh, par, graphdef, tx, shardings, log)
    return TrainProgram(plan, mesh, par, ocfg, tx, graphdef, shardings, abstract, create, step,
                        NamedSharding(mesh, P(None, "data")), state)


def _train_step(config: ConfigDict, plan: Plan, mesh, par: ParallelConfig, graphdef, tx, shardings, log):
    cfg = plan.model
    reset = bool(config.data.reset_at_documents)
    ce_chunk = int(config.train.get("ce_chunk_tokens", 0)) or None  # chunked head + CE for large vocabularies
    view_dtype = cfg.dtype if config.train.get("cast_weights_once", True) else None
    balancer = BalancerConfig(**dict(config.balancing))
    grad_fn = None
    if zero_axes(mesh):  # several devices: per-device gradients in shard_map, reduced explicitly (data_parallel.py)
        cp = None
        if mesh.shape["context"] > 1:  # context parallelism: zigzag sequence shards, ring / all-gather attention
            cp = ContextParallel(Zigzag(mesh.shape["context"], plan.seq_len),
                                 attention=par.context_attention, impl=cfg.attention_impl)
            cp.check(cfg)
        grad_spec_of = zero1_spec_fn(mesh) if par.zero1 else (lambda shape: P())
        local_sums = make_local_loss_sums(graphdef, reset, cp, ce_chunk, balance_tokens=balancer.learning_rate > 0)
        grad_fn = sharded_value_and_grad(local_sums, mesh, grad_spec_of, zigzag=cp.zigzag if cp else None)
    # train.per_layer_view (default on; off only in benchmarks): with unrolled layers, the compute-dtype view is
    # sliced per layer once per step
    per_layer_view = (view_dtype is not None and not cfg.scan_layers
                      and bool(config.train.get("per_layer_view", True)))
    # deferred expert gradients: one device (the default gradient function) with the per-layer view and Pallas experts
    defer_wgrad = (bool(config.train.get("defer_expert_wgrad", True)) and grad_fn is None and per_layer_view
                   and cfg.moe_impl == "pallas")
    if config.train.get("defer_expert_wgrad", True) and not defer_wgrad and plan.accumulation > 1:
        why = ("several devices" if grad_fn is not None else "layers under lax.scan or no compute-dtype view"
               if not per_layer_view else f"moe_impl {cfg.moe_impl!r}")
        log(f"train.defer_expert_wgrad: not used ({why}; it needs one device, unrolled layers, the per-layer view "
            "and moe_impl 'pallas')")
    # out_shardings pin the state's layout (ZeRO-1 shards stay shards, parameters stay replicated). One compiled
    # program per distinct k (the leading axis of the stacked batches): jit retraces when a batch ramp changes k,
    # each ramp value compiles once and the full batch's program serves every step after the ramp.
    return jax.jit(make_accumulating_train_step(graphdef, tx, balancer,
                                                reset_at_documents=reset, ce_chunk_tokens=ce_chunk,
                                                grad_fn=grad_fn, compute_dtype=view_dtype,
                                                per_layer_view=per_layer_view,
                                                grads_per_pass=int(config.train.get("grads_per_pass", 1)),
                                                defer_expert_wgrad=defer_wgrad),
                   donate_argnums=0,
                   out_shardings=(shardings, NamedSharding(mesh, P())),
                   compiler_options=combine_threshold_options(par.bucket_bytes))

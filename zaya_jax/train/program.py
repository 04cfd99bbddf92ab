"""The train program: mesh, model, optimizer, train state and the sharded, jitted train step, assembled from a run's
config in one place. The trainer (train/loop.py) runs it; the benchmarks (benchmarks/training/bench_programs.py,
benchmarks/systems/scaling_step.py, benchmarks/systems/breakdown.py) compile it, so they measure the program the
trainer runs."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from zaya_jax.checkpoint.manager import abstract_like
from zaya_jax.config import ModelConfig, preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.model_info import describe
from zaya_jax.optim.balancing import init_balancer
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from zaya_jax.parallel.config import ParallelConfig
from zaya_jax.parallel.data_parallel import sharded_value_and_grad
from zaya_jax.parallel.mesh import describe_mesh, make_mesh
from zaya_jax.parallel.sharding import (combine_threshold_options, describe_optimizer_memory, state_shardings, zero1,
                                         zero1_spec_fn, zero_axes)
from zaya_jax.train.options import BatchRamp, RunOptions, run_options
from zaya_jax.train.state_memory import check_state_fits
from zaya_jax.train.step_options import check_on_mesh, context_parallel, pallas_settings, step_options
from zaya_jax.train.step import make_accumulating_train_step, make_local_loss_sums


@dataclasses.dataclass
class Plan:
    """Sizes derived from the config, validated once, and the run's typed options (train/options.py)."""

    model: ModelConfig
    seq_len: int
    micro_rows: int  # sequences per microbatch, global
    accumulation: int  # microbatches per optimizer step (after any batch ramp)
    steps: int  # optimizer steps
    ramp: tuple[int, ...] = ()  # microbatches of the first optimizer steps while the batch ramps up
    options: RunOptions | None = None

    def accumulation_at(self, step: int) -> int:
        return self.ramp[step] if step < len(self.ramp) else self.accumulation


def make_plan(config: ConfigDict) -> Plan:
    opts = run_options(config)
    cfg = preset(config.model.preset, **dict(config.model.get("overrides", {})))
    t, seq = opts.train, opts.data.seq_len
    accumulation = t.global_batch_tokens // t.microbatch_tokens
    return Plan(cfg, seq, t.microbatch_tokens // seq, accumulation, t.steps,
                batch_ramp(t.batch_ramp, t.microbatch_tokens, accumulation), opts)


def batch_ramp(ramp: BatchRamp, microbatch_tokens: int, accumulation: int) -> tuple[int, ...]:
    """Microbatches per step while the global batch grows linearly, in tokens, from `start_tokens` to the full
    batch over the first `ramp_tokens` tokens trained (rounded up to whole microbatches). The ramp's values are
    checked by train/options.py."""
    start, span = ramp.start_tokens, ramp.ramp_tokens
    if not span:
        return ()
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
    opts, cfg = plan.options, plan.model
    mesh_args = dataclasses.asdict(opts.mesh)
    if os.environ.get("ZAYA_NUM_DEVICES"):  # set by the supervisor when it restarts on fewer devices
        mesh_args["num_devices"] = int(os.environ["ZAYA_NUM_DEVICES"])
    mesh = make_mesh(**mesh_args)
    check_on_mesh(opts, cfg, mesh, plan.micro_rows)  # before any parameter or optimizer state exists
    pallas = pallas_settings(opts, cfg)
    if pallas and mesh.devices.flat[0].platform == "cpu":
        log(f"note: {', '.join(pallas)} run in Pallas' interpret mode on the CPU, many times slower than XLA; "
            "set them to 'xla' (moe_impl: 'ragged') for CPU runs")
    log(describe(cfg))
    log(describe_mesh(mesh))
    ocfg, par = opts.optim, opts.parallel
    if tx is None:
        tx = build_optimizer(ocfg, None, log=None)
    if par.zero1:  # optimizer state sharded over the batch axes (parallel/sharding.py); a no-op on one device
        tx = zero1(tx, mesh, muon=par.muon_placement)
    graphdef = graphdef_of(cfg, opts.seed)
    create = state_creator(cfg, tx, opts.seed)
    shapes = jax.eval_shape(create)
    shardings = state_shardings(shapes, mesh, zero1=par.zero1)
    abstract = abstract_like(shapes, shardings)
    check_state_fits(abstract, mesh)  # before any of it exists
    state = jax.jit(create, out_shardings=shardings)() if init else None
    log(describe_optimizer_memory(state["opt_state"] if init else abstract["opt_state"], mesh))
    step = _train_step(plan, mesh, graphdef, tx, shardings, log)
    return TrainProgram(plan, mesh, par, ocfg, tx, graphdef, shardings, abstract, create, step,
                        NamedSharding(mesh, P(None, "data")), state)


def _train_step(plan: Plan, mesh, graphdef, tx, shardings, log):
    opts, cfg, par = plan.options, plan.model, plan.options.parallel
    balancer = opts.balancing
    grad_fn = None
    if zero_axes(mesh):  # several devices: per-device gradients in shard_map, reduced explicitly (data_parallel.py)
        cp = context_parallel(opts, cfg, mesh)  # checked by check_on_mesh
        grad_spec_of = zero1_spec_fn(mesh) if par.zero1 else (lambda shape: P())
        local_sums = make_local_loss_sums(graphdef, opts.data.reset_at_documents, cp,
                                          opts.train.ce_chunk_tokens or None,
                                          balance_tokens=balancer.learning_rate > 0,
                                          solve=balancer.learning_rate > 0)
        grad_fn = sharded_value_and_grad(local_sums, mesh, grad_spec_of, zigzag=cp.zigzag if cp else None)
    # which of the step's options apply here (per-layer view, deferred expert gradients): train/step_options.py
    so = step_options(opts, cfg, several_devices=grad_fn is not None, accumulation=plan.accumulation)
    if so.note:
        log(so.note)
    # out_shardings pin the state's layout (ZeRO-1 shards stay shards, parameters stay replicated). One compiled
    # program per distinct k (the leading axis of the stacked batches): jit retraces when a batch ramp changes k,
    # each ramp value compiles once and the full batch's program serves every step after the ramp.
    return jax.jit(make_accumulating_train_step(graphdef, tx, balancer,
                                                reset_at_documents=so.reset_at_documents,
                                                ce_chunk_tokens=so.ce_chunk_tokens,
                                                grad_fn=grad_fn, compute_dtype=so.compute_dtype,
                                                per_layer_view=so.per_layer_view,
                                                grads_per_pass=so.grads_per_pass,
                                                defer_expert_wgrad=so.defer_expert_wgrad),
                   donate_argnums=0,
                   out_shardings=(shardings, NamedSharding(mesh, P())),
                   compiler_options=combine_threshold_options(par.bucket_bytes))

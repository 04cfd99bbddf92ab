"""The trainer's step on the first k devices, built ahead of time for the scaling runs (benchmarks/scaling.py).

The same builders as zaya_jax/train/loop.py, with the trainer's ParallelConfig defaults: mesh (data x context),
Muon + AdamW with ZeRO-1, per-device gradients in
shard_map reduced explicitly (data_parallel.py), zigzag context parallelism (context.py), the jitted
make_train_step with the state donated. It is lowered from abstract shapes, so several device counts can compile
at once (XLA compiles on the host, threads overlap) before any of their states takes device memory. Batches are
random tokens (throughput does not depend on the text); `capture_grads` keeps each step's reduced gradients in
the optimizer state, so runs on different meshes can be compared gradient by gradient.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.config import ModelConfig
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.optim.balancing import BalancerConfig, init_balancer
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from zaya_jax.parallel.config import ParallelConfig
from zaya_jax.parallel.context import ContextParallel
from zaya_jax.parallel.data_parallel import sharded_value_and_grad
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.parallel.sharding import (
    combine_threshold_options,
    state_shardings,
    zero1,
    zero1_spec_fn,
    zero_axes,
)
from zaya_jax.parallel.zigzag import Zigzag
from zaya_jax.train.step import make_local_loss_sums, make_train_step


@dataclasses.dataclass(frozen=True)
class StepSpec:
    cfg: ModelConfig
    seq_len: int
    rows: int  # sequences per step, all devices together
    devices: int  # the first `devices` devices
    context: int = 1
    zero1: bool = True
    context_attention: str = "allgather"
    ce_chunk: int | None = None  # chunked head + cross-entropy (not under context parallelism: full logits there)
    capture_grads: bool = False
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)  # the trainer's defaults
    optimizer: OptimizerConfig = dataclasses.field(
        default_factory=lambda: OptimizerConfig(warmup_steps=10, total_steps=1000))

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def capture_grads(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """tx whose state also holds the gradients of the last update (state = (grads, tx's state))."""
    def init(params):
        return jax.tree.map(jnp.zeros_like, params), tx.init(params)

    def update(grads, state, params=None, **extra):
        updates, inner = tx.update(grads, state[1], params, **extra)
        return updates, (grads, inner)

    return optax.GradientTransformationExtraArgs(init, update)


class MeshStep:
    """One spec's mesh, train step and abstract state; `compile()` then `init_state()` and `step(...)`."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        self.mesh = make_mesh(num_devices=spec.devices, context=spec.context)
        cfg = spec.cfg
        if cfg.attention_impl == "cudnn" and zero_axes(self.mesh):
            # cuDNN attention must be lowered with one mesh for the whole program, but the gradients' shard_map
            # runs on data_parallel.py's (node, data_local) view of the mesh: XLA refuses the program
            raise ValueError(f"attention_impl='cudnn' cannot run on {spec.devices} devices (the per-device "
                             f"gradients' shard_map uses a second, hierarchical mesh); use 'xla' or 'pallas'")
        tx = build_optimizer(spec.optimizer, None, log=None)
        tx = capture_grads(tx) if spec.capture_grads else tx
        self.tx = zero1(tx, self.mesh, muon=spec.parallel.muon_placement) if spec.zero1 else tx
        abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, seed=0))
        self.graphdef = nnx.split(abstract, nnx.Param, BalancingBias)[0]
        shapes = jax.eval_shape(self._create)
        self.shardings = state_shardings(shapes, self.mesh, zero1=spec.zero1)
        self.abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                                           self.shardings)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        grad_fn = None
        if zero_axes(self.mesh):
            cp = None
            if spec.context > 1:
                cp = ContextParallel(Zigzag(spec.context, spec.seq_len), attention=spec.context_attention,
                                     impl=cfg.attention_impl)
                cp.check(cfg)
            grad_spec_of = zero1_spec_fn(self.mesh) if spec.zero1 else (lambda shape: P())
            grad_fn = sharded_value_and_grad(make_local_loss_sums(self.graphdef, False, cp, spec.ce_chunk),
                                             self.mesh, grad_spec_of, zigzag=cp.zigzag if cp else None)
        train_step = make_train_step(self.graphdef, self.tx, BalancerConfig(), ce_chunk_tokens=spec.ce_chunk,
                                     grad_fn=grad_fn)
        self.step = jax.jit(train_step, donate_argnums=0,
                            out_shardings=(self.shardings, NamedSharding(self.mesh, P())),
                            compiler_options=combine_threshold_options(spec.parallel.bucket_bytes))
        self.compiled = None
        self.compile_s = None

    def _create(self):
        """The train state as zaya_jax.train.loop.init_state creates it."""
        cfg = self.spec.cfg
        _, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=0), nnx.Param, BalancingBias)
        params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params),
                "model_state": model_state, "balancer": init_balancer(cfg.num_hidden_layers, cfg.num_experts)}

    def batch_shapes(self) -> dict:
        s, n = self.spec, self.spec.rows
        field = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
        return {"inputs": field((n, s.seq_len), jnp.int32), "targets": field((n, s.seq_len), jnp.int32),
                "loss_mask": field((n, s.seq_len), jnp.float32), "source_ids": field((n,), jnp.int32)}

    def compile(self) -> float:
        """Lowers and compiles from abstract shapes (thread-safe to run for several specs at once)."""
        t = time.perf_counter()
        self.compiled = self.step.lower(self.abstract_state, self.batch_shapes()).compile()
        self.compile_s = time.perf_counter() - t
        return self.compile_s

    def init_state(self):
        return jax.jit(self._create, out_shardings=self.shardings)()

    def batch(self, seed: int = 0) -> dict:
        """Random tokens (the same for every mesh with the same seed and shape)."""
        s, vocab = self.spec, self.spec.cfg.vocab_size

        def make():
            ids = jax.random.randint(jax.random.key(seed), (s.rows, s.seq_len + 1), 3, vocab, dtype=jnp.int32)
            return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((s.rows, s.seq_len)),
                    "source_ids": jnp.zeros((s.rows,), jnp.int32)}

        return jax.jit(make, out_shardings=jax.tree.map(lambda _: self.batch_sharding, self.batch_shapes()))()

    def run(self, state, batch):
        fn = self.compiled if self.compiled is not None else self.step
        return fn(state, batch)


def time_steps(ms: MeshStep, state, batch, *, warmup: int, steps: int, samples: int = 3):
    """(state, median seconds per step over `samples` runs of `steps` back-to-back steps, last loss)."""
    metrics = None
    for _ in range(warmup):
        state, metrics = ms.run(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(steps):
            state, metrics = ms.run(state, batch)
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - t) / steps)
    times.sort()
    return state, times[len(times) // 2], float(metrics["loss"])


def step_memory_gib(ms: MeshStep) -> float | None:
    """One device's footprint of the compiled step from XLA's memory analysis: state and batch in, outputs, minus
    the donated state, plus temporaries (None where the backend gives no analysis)."""
    try:
        m = ms.compiled.memory_analysis()
        total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes)
    except (AttributeError, TypeError):
        return None
    return total / 2 ** 30

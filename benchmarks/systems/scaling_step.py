"""The trainer's step on the first k devices, built ahead of time for the scaling runs (benchmarks/scaling.py).

The trainer's own program (zaya_jax/train/program.py build_train_program, what zaya_jax/train/loop.py runs) from a
config made of the spec on top of configs/default.py, with the trainer's ParallelConfig defaults: mesh (data x
context), Muon + AdamW with ZeRO-1, per-device gradients in shard_map reduced explicitly (data_parallel.py), zigzag
context parallelism (context.py), the jitted accumulating step (one microbatch per step here) with the state
donated. It is lowered from abstract shapes, so several device counts can compile at once (XLA compiles on the
host, threads overlap) before any of their states takes device memory. Batches are random tokens (throughput does
not depend on the text); `capture_grads` keeps each step's reduced gradients in the optimizer state, so runs on
different meshes can be compared gradient by gradient.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict

from configs.default import get_config
from zaya_jax.config import ModelConfig
from zaya_jax.optim.balancing import BalancerConfig
from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from zaya_jax.parallel.config import ParallelConfig
from zaya_jax.train.program import build_train_program


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
    balancing: bool = True  # the bias controller (off where runs on different token splits are compared exactly)
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


def train_config(spec: StepSpec) -> ConfigDict:
    """The trainer's config of a spec: configs/default.py with the spec's model (the preset of the released
    defaults, every field given), batch, mesh, parallelism, optimizer and the default bias controller (or none)."""
    c = get_config()
    c.seed = 0
    c.model = ConfigDict(dict(preset="zaya1_8b", overrides=ConfigDict(
        {f.name: getattr(spec.cfg, f.name) for f in dataclasses.fields(spec.cfg)})))
    c.data.seq_len = spec.seq_len
    c.train.update(steps=1, global_batch_tokens=spec.tokens, microbatch_tokens=spec.tokens,
                   ce_chunk_tokens=spec.ce_chunk or 0)
    c.optim = ConfigDict(dataclasses.asdict(spec.optimizer))
    balancer = BalancerConfig() if spec.balancing else BalancerConfig(learning_rate=0.0)
    c.balancing = ConfigDict(dataclasses.asdict(balancer))
    c.mesh = ConfigDict(dict(data=-1, context=spec.context, num_devices=spec.devices))
    c.parallel = ConfigDict(dict(dataclasses.asdict(spec.parallel), zero1=spec.zero1,
                                 context_attention=spec.context_attention))
    return c


class MeshStep:
    """One spec's mesh, train step and abstract state; `compile()` then `init_state()` and `step(...)`."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        tx = None
        if spec.capture_grads:  # the optimizer the config builds, its state also holding the gradients
            tx = capture_grads(build_optimizer(spec.optimizer, None, log=None))
        self.program = build_train_program(train_config(spec), log=None, init=False, tx=tx)
        self.mesh, self.tx, self.graphdef = self.program.mesh, self.program.tx, self.program.graphdef
        self.shardings, self.abstract_state = self.program.shardings, self.program.abstract_state
        self.batch_sharding = self.program.batch_sharding  # [1 microbatch, rows, ...]
        self.step = self.program.step
        self.compiled = None
        self.compile_s = None

    def batch_shapes(self) -> dict:
        s, n = self.spec, self.spec.rows
        field = lambda shape, dtype: jax.ShapeDtypeStruct((1,) + shape, dtype, sharding=self.batch_sharding)
        return {"inputs": field((n, s.seq_len), jnp.int32), "targets": field((n, s.seq_len), jnp.int32),
                "loss_mask": field((n, s.seq_len), jnp.float32), "source_ids": field((n,), jnp.int32)}

    def compile(self) -> float:
        """Lowers and compiles from abstract shapes (thread-safe to run for several specs at once)."""
        t = time.perf_counter()
        self.compiled = self.step.lower(self.abstract_state, self.batch_shapes()).compile()
        self.compile_s = time.perf_counter() - t
        return self.compile_s

    def init_state(self):
        return self.program.init_state()

    def batch(self, seed: int = 0) -> dict:
        """Random tokens, one microbatch [1, rows, ...] (the same for every mesh with the same seed and shape)."""
        s, vocab = self.spec, self.spec.cfg.vocab_size

        def make():
            ids = jax.random.randint(jax.random.key(seed), (s.rows, s.seq_len + 1), 3, vocab, dtype=jnp.int32)
            batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((s.rows, s.seq_len)),
                     "source_ids": jnp.zeros((s.rows,), jnp.int32)}
            return jax.tree.map(lambda x: x[None], batch)

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

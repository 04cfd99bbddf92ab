"""The run config's groups as typed, frozen options, built and checked once by `run_options` before anything is
built: defaults applied, unknown keys refused, every value's type and range checked, and the combinations the
config alone decides (batch arithmetic, batch ramp, data sources and weights, schedule length) -- each refused in
one line naming the key and its value (TrainConfigError). The library reads these options, not
`config.train.get(k, default)`; the ConfigDict stays the user-facing and recorded form (run.json,
--config.train.x=...). The combinations that need the model and the mesh: train/step_options.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zaya_jax.data.corpus import SOURCES as BUILTIN_SOURCES
from zaya_jax.optim.balancing import BalancerConfig
from zaya_jax.optim.optimizer import OptimizerConfig, group_transforms
from zaya_jax.optim.schedules import cooldown_steps
from zaya_jax.parallel.config import ParallelConfig
from zaya_jax.parallel.context import ATTENTION_VARIANTS
from zaya_jax.parallel.sharding import MUON_PLACEMENTS
from zaya_jax.train.errors import TrainConfigError
from zaya_jax.train.typed_groups import build, is_mapping, typed


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    start_tokens: int = 0  # the global batch of the first step, in tokens
    ramp_tokens: int = 0  # tokens trained over which it grows linearly to train.global_batch_tokens; 0: no ramp


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Group `train` (configs/default.py documents each key)."""

    steps: int  # optimizer steps
    global_batch_tokens: int  # tokens per optimizer step
    microbatch_tokens: int  # tokens per microbatch (global); global_batch_tokens / microbatch_tokens per step
    log_every: int
    checkpoint_every: int
    batch_ramp: BatchRamp = BatchRamp()
    eval_every: int = 0  # 0 (or None in a config): no evaluation
    eval_batches: int | None = None  # None: every held-out batch
    keep_checkpoints: int | None = None  # None: keep all
    init_from: str = ""  # a previous run's (or a Hugging Face) directory to take the weights from
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: look up the device kind
    ce_chunk_tokens: int = 0  # > 0: head + cross-entropy in chunks of this many tokens
    cast_weights_once: bool = True  # the compute-dtype view of the weights, once per step
    per_layer_view: bool = True  # with unrolled layers, that view also sliced per layer (off only in benchmarks)
    grads_per_pass: int = 1  # microbatch gradients added to the fp32 sum in one pass
    # where it applies (one device, unrolled layers, the per-layer view, moe_impl 'pallas'; train/step_options.py)
    defer_expert_wgrad: bool = True
    fault: str = ""  # fault injection for drills, e.g. "nan@12,hang@30"


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """Group `data`."""

    seq_len: int
    tokenizer: str = "byte"  # 'byte' or a tokenizer.json path
    builtin: bool = True  # the built-in corpus; else `sources`
    sources: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> indexed prefix (or a list of them)
    valid_sources: dict[str, Any] = dataclasses.field(default_factory=dict)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> mixture weight
    reset_at_documents: bool = False
    prefetch: int = 4

    def training_source_names(self) -> set[str] | None:
        """The training sources' names, or None when the config leaves them to the command line."""
        if self.builtin:
            return set(BUILTIN_SOURCES)
        return set(self.sources) or None


@dataclasses.dataclass(frozen=True)
class MeshOptions:
    """Group `mesh`: zaya_jax/parallel/mesh.py make_mesh's arguments."""

    data: int = -1  # -1: every device the other axes leave
    context: int = 1
    num_devices: int = 0  # 0: all
    expert: int = 1
    tensor: int = 1
    local_per_node: int = 0


@dataclasses.dataclass(frozen=True)
class RunOptions:
    seed: int
    train: TrainOptions
    data: DataOptions
    optim: OptimizerConfig  # total_steps resolved: 0 means train.steps
    parallel: ParallelConfig
    balancing: BalancerConfig
    mesh: MeshOptions


def run_options(config) -> RunOptions:
    """The typed, checked options of a run config (a ConfigDict, or a dict of groups)."""
    known = {"seed", "model", "train", "data", "optim", "parallel", "balancing", "mesh"}
    unknown = sorted(set(config.keys()) - known)
    if unknown:
        raise TrainConfigError(f"config: unknown group{'s' if len(unknown) > 1 else ''} "
                               f"{', '.join(map(repr, unknown))} (known: {', '.join(sorted(known))})")
    # each group typed first, then each value's range, then the combinations of values
    train = build(TrainOptions, "train", _eval_every_none_is_0(config.get("train")))
    data = build(DataOptions, "data", config.get("data"))
    optim = build(OptimizerConfig, "optim", config.get("optim"))
    opts = RunOptions(seed=typed("seed", config.get("seed", 0), int), train=train, data=data, optim=optim,
                      parallel=build(ParallelConfig, "parallel", config.get("parallel")),
                      balancing=build(BalancerConfig, "balancing", config.get("balancing")),
                      mesh=build(MeshOptions, "mesh", config.get("mesh")))
    _check_train(train, data.seq_len)
    _check_data(data)
    _check_parallel(opts.parallel)
    _check_balancing(opts.balancing)
    given = is_mapping(config.get("optim")) and "total_steps" in config.get("optim").keys()
    opts = dataclasses.replace(opts, optim=_schedule(optim, train.steps, given_total=given))
    return opts


def _eval_every_none_is_0(group):
    if is_mapping(group) and "eval_every" in group.keys() and group["eval_every"] is None:
        return {**dict(group.items()), "eval_every": 0}
    return group


def _check_train(t: TrainOptions, seq: int) -> None:
    positive = {"data.seq_len": seq, "train.steps": t.steps, "train.log_every": t.log_every,
                "train.checkpoint_every": t.checkpoint_every, "train.global_batch_tokens": t.global_batch_tokens,
                "train.microbatch_tokens": t.microbatch_tokens}
    for name, v in positive.items():
        if v < 1:
            raise TrainConfigError(f"{name}={v!r} must be a positive whole number")
    if t.eval_every < 0:
        raise TrainConfigError(f"train.eval_every={t.eval_every} must be >= 0 (0: no evaluation)")
    for name, what in (("eval_batches", "every held-out batch"), ("keep_checkpoints", "keep all")):
        if getattr(t, name) is not None and getattr(t, name) < 1:
            raise TrainConfigError(f"train.{name}={getattr(t, name)} must be >= 1 (or None: {what})")
    for name in ("ce_chunk_tokens", "peak_tflops"):
        if not 0 <= getattr(t, name) < math.inf:
            raise TrainConfigError(f"train.{name}={getattr(t, name)!r} must be >= 0 (0: off)")
    for name in ("global_batch_tokens", "microbatch_tokens"):
        if getattr(t, name) % seq:
            raise TrainConfigError(f"train.{name}={getattr(t, name)} is not a multiple of data.seq_len={seq}")
    if t.global_batch_tokens % t.microbatch_tokens:
        raise TrainConfigError(f"train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                               f"train.microbatch_tokens={t.microbatch_tokens}")
    if t.grads_per_pass < 1:
        raise TrainConfigError(f"train.grads_per_pass={t.grads_per_pass} must be >= 1 (microbatch gradients added to "
                               "the fp32 sum in one pass)")
    r = t.batch_ramp
    if r.ramp_tokens < 0:
        raise TrainConfigError(f"train.batch_ramp.ramp_tokens={r.ramp_tokens} must be >= 0 (0: no ramp)")
    if r.ramp_tokens and not 0 < r.start_tokens <= t.global_batch_tokens:
        raise TrainConfigError(f"train.batch_ramp.start_tokens={r.start_tokens} must be in (0, global_batch_tokens]")


def _check_data(d: DataOptions) -> None:
    if d.prefetch < 0:
        raise TrainConfigError(f"data.prefetch={d.prefetch} must be >= 0")
    for group in ("sources", "valid_sources"):
        for name, prefix in getattr(d, group).items():
            if not (isinstance(prefix, str) or (isinstance(prefix, (list, tuple)) and prefix
                                                and all(isinstance(p, str) for p in prefix))):
                raise TrainConfigError(f"data.{group}.{name}={prefix!r} must be an indexed-dataset prefix "
                                       "(or a list of them)")
    for name, w in d.weights.items():
        if not 0 <= w < math.inf:
            raise TrainConfigError(f"data.weights.{name}={w!r} must be a finite number >= 0")
    if d.builtin and d.sources:
        raise TrainConfigError(f"data.builtin is True but data.sources names {sorted(d.sources)}: set "
                               "data.builtin=False to train on them")
    if d.builtin and d.valid_sources:
        raise TrainConfigError("data.valid_sources needs data.sources: the built-in corpus has its own held-out "
                               "split")
    names = d.training_source_names()  # None: the sources come on the command line (checked when the run sets up)
    if names is not None and set(d.weights) != names:
        raise TrainConfigError(f"data.weights names {sorted(d.weights)} but the training sources are "
                               f"{sorted(names)}: give every source a weight")


def _check_parallel(p: ParallelConfig) -> None:
    if p.muon_placement not in MUON_PLACEMENTS:
        raise TrainConfigError(f"parallel.muon_placement={p.muon_placement!r} must be one of {MUON_PLACEMENTS}")
    if p.context_attention not in ATTENTION_VARIANTS:
        raise TrainConfigError(f"parallel.context_attention={p.context_attention!r} must be one of "
                               f"{ATTENTION_VARIANTS}")
    if p.bucket_bytes < 0:
        raise TrainConfigError(f"parallel.bucket_bytes={p.bucket_bytes} must be >= 0 (0: XLA's default)")


def _schedule(o: OptimizerConfig, steps: int, *, given_total: bool) -> OptimizerConfig:
    """The schedule follows the run: optim.total_steps 0 (or unset) means train.steps; one shorter than
    train.steps is refused (its last steps would train at learning rate 0)."""
    if not 0 <= o.learning_rate < math.inf:
        raise TrainConfigError(f"optim.learning_rate={o.learning_rate!r} must be a finite number >= 0")
    total = o.total_steps if given_total else 0
    if total < 0:
        raise TrainConfigError(f"optim.total_steps={total} must be >= 0 (0: follows train.steps)")
    follows = total == 0
    if follows:
        o = dataclasses.replace(o, total_steps=steps)
    elif total < steps:
        raise TrainConfigError(f"train.steps={steps} runs past optim.total_steps={total} (learning rate 0 after it): "
                               f"set --config.optim.total_steps={steps}, or 0 to follow train.steps")
    if o.schedule != "constant" and o.warmup_steps > o.total_steps:
        raise TrainConfigError(f"optim.warmup_steps={o.warmup_steps} is longer than the schedule "
                               f"({o.total_steps} steps): lower --config.optim.warmup_steps")
    fits = lambda n: o.warmup_steps + cooldown_steps(n, o.decay_fraction) <= n  # noqa: E731
    if o.schedule == "wsd" and 0 <= o.decay_fraction < 1 and not fits(o.total_steps):
        # the shortest schedule with room for both: the cooldown grows by decay_fraction per step, so one exists
        shortest = next(n for n in range(o.total_steps, 10 ** 9) if fits(n))
        raise TrainConfigError(
            f"a schedule of {o.total_steps} steps has no room for optim.warmup_steps={o.warmup_steps} and the "
            f"cooldown (optim.decay_fraction={o.decay_fraction}: "
            f"{cooldown_steps(o.total_steps, o.decay_fraction)} steps): set "
            f"--config.{'train.steps' if follows else 'optim.total_steps'}={shortest} or more, or lower "
            "--config.optim.warmup_steps or --config.optim.decay_fraction")
    try:  # the schedule's and Muon's own checks (names, decay length, Newton-Schulz settings) before any model
        group_transforms(o)
    except (ValueError, TypeError) as e:
        raise TrainConfigError(f"optim: {e}") from None
    return o


def _check_balancing(b: BalancerConfig) -> None:
    if not 0 <= b.learning_rate < math.inf:
        raise TrainConfigError(f"balancing.learning_rate={b.learning_rate!r} must be a finite number >= 0 (0: no "
                               "balancing; a negative rate pushes every token onto one expert)")
    if not math.isfinite(b.skip_bias):
        raise TrainConfigError(f"balancing.skip_bias={b.skip_bias!r} must be a finite number")

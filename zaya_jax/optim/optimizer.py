"""The ZAYA1 optimizer: Muon on the weight matrices, AdamW on the rest (see partition.py), one learning-rate
schedule for both (Moonlight shape scale), global-norm gradient clipping, and the start-up table of which parameter
goes where with its optimizer-state bytes.

    clip_by_global_norm -> partition{muon: inject_hyperparams(muon), adamw: inject_hyperparams(adamw)}

Gradient accumulation is not the optimizer's business: the train step sums the micro-gradients of an optimizer
step in one program and calls update once with their mean (zaya_jax/train/step.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from zaya_jax.optim import partition
from zaya_jax.optim.muon import muon
from zaya_jax.optim.schedules import warmup_cosine, warmup_stable_decay

SCHEDULES = ("wsd", "cosine", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4  # peak; shared by Muon and AdamW (Moonlight scale), times muon_lr_multiplier
    schedule: str = "wsd"
    warmup_steps: int = 2000
    total_steps: int = 100_000
    decay_fraction: float = 0.2  # wsd: length of the cooldown
    cooldown: str = "linear"  # wsd: 'linear' | '1-sqrt'
    end_lr_fraction: float = 0.0  # final lr = learning_rate * end_lr_fraction
    weight_decay: float = 0.1  # decoupled, on Muon matrices and decayed AdamW matrices (partition.py)
    clip_norm: float | None = 1.0  # global gradient norm over all parameters; None = no clipping
    # Muon
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "bfloat16"
    muon_shape_scale: str = "moonlight"  # 'moonlight' | 'keller' | 'none'
    muon_rms: float = 0.2
    muon_gram_impl: str = "xla"  # 'xla' | 'pallas' (symmetric Gram kernel)
    muon_lr_multiplier: float = 1.0  # e.g. ~50 with the Keller scale, whose updates have RMS ~1/sqrt(fan_in)
    # AdamW
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    end = cfg.learning_rate * cfg.end_lr_fraction
    if cfg.schedule == "wsd":
        return warmup_stable_decay(cfg.learning_rate, cfg.warmup_steps, cfg.total_steps,
                                   decay_fraction=cfg.decay_fraction, cooldown=cfg.cooldown, end_value=end)
    if cfg.schedule == "cosine":
        return warmup_cosine(cfg.learning_rate, cfg.warmup_steps, cfg.total_steps, end_value=end)
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.learning_rate)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")


def group_transforms(cfg: OptimizerConfig) -> dict[str, optax.GradientTransformation]:
    """The two per-group optimizers, with their learning rates injected (readable in the state)."""
    schedule = make_schedule(cfg)
    multiplier = cfg.muon_lr_multiplier
    muon_schedule = schedule if multiplier == 1.0 else (lambda step: multiplier * schedule(step))
    muon_tx = optax.inject_hyperparams(muon, static_args=("ns_steps",))(
        learning_rate=muon_schedule, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
        nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, ns_dtype=cfg.muon_ns_dtype,
        shape_scale=cfg.muon_shape_scale, rms=cfg.muon_rms, gram_impl=cfg.muon_gram_impl)
    adamw_tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
        mask=partition.decay_mask)
    return {partition.MUON: muon_tx, partition.ADAMW: adamw_tx}


def build_optimizer(cfg: OptimizerConfig, params=None, *,
                    log: Callable[[str], None] | None = print) -> optax.GradientTransformation:
    """The full gradient transformation. With `params` (arrays or ShapeDtypeStructs), checks the Muon shapes and
    logs the partition table."""
    if params is not None:
        partition.check_muon_shapes(params)
    parts = optax.partition(group_transforms(cfg), partition.label_params)
    tx = parts if cfg.clip_norm is None else optax.chain(optax.clip_by_global_norm(cfg.clip_norm), parts)
    if params is not None and log is not None:
        log(partition_table(params, cfg, tx))
    return tx


def learning_rates(opt_state) -> dict[str, jax.Array]:
    """The learning rate each group used in its last update, read from the injected hyperparameters."""
    out = {}
    for path, value in optax.tree.get_all_with_path(opt_state, "learning_rate"):
        names = [partition.key_name(k) for k in path]
        if "hyperparams" not in names:  # skip the schedules' own states, stored under the same name
            continue
        group = next((n for n in names if n in (partition.MUON, partition.ADAMW)), "?")
        out[group] = value
    return out


# ---- start-up table ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PartitionRow:
    path: str
    shape: tuple[int, ...]
    group: str  # 'muon' | 'adamw'
    decayed: bool
    matrices: int  # Muon: matrices orthogonalised one by one (product of the leading dims); AdamW: 0
    params: int
    state_bytes: int  # this parameter's optimizer-state buffers (momentum, moments)


def _nbytes(tree, *, arrays_only: bool) -> int:
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves if x.shape or not arrays_only)


def partition_rows(params, cfg: OptimizerConfig) -> list[PartitionRow]:
    transforms = group_transforms(cfg)
    rows = []
    for kp, p in jax.tree_util.tree_leaves_with_path(params):
        path = partition.param_path(kp)
        group = partition.group_of(path)
        state = jax.eval_shape(transforms[group].init, jax.ShapeDtypeStruct(p.shape, p.dtype))
        rows.append(PartitionRow(path, tuple(p.shape), group, partition.is_decayed(path),
                                 math.prod(p.shape[:-2]) if group == partition.MUON else 0, math.prod(p.shape),
                                 _nbytes(state, arrays_only=True)))
    return rows


def optimizer_state_bytes(params, tx: optax.GradientTransformation) -> int:
    """Everything tx.init allocates for params: buffers, counters, hyperparameters."""
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    return _nbytes(jax.eval_shape(tx.init, abstract), arrays_only=False)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def partition_table(params, cfg: OptimizerConfig, tx: optax.GradientTransformation | None = None) -> str:
    """One row per parameter, then per-group totals and the whole optimizer state."""
    rows = partition_rows(params, cfg)
    head = ("parameter", "shape", "optimizer", "decay", "matrices", "params", "state")
    cells = [(r.path, "x".join(map(str, r.shape)), r.group, "yes" if r.decayed else "-", str(r.matrices or "-"),
              f"{r.params:,}", _fmt_bytes(r.state_bytes)) for r in rows]
    widths = [max(len(c[i]) for c in cells + [head]) for i in range(len(head))]
    line = lambda c: "  ".join(x.ljust(w) if i < 4 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths)))
    out = [line(head), "-" * len(line(head))] + [line(c) for c in cells] + [""]
    for group in (partition.MUON, partition.ADAMW):
        mine = [r for r in rows if r.group == group]
        out.append(f"{group:>6}: {len(mine)} tensors, {sum(r.matrices for r in mine)} matrices, "
                   f"{sum(r.params for r in mine):,} parameters, optimizer state "
                   f"{_fmt_bytes(sum(r.state_bytes for r in mine))}")
    tx = tx if tx is not None else build_optimizer(cfg, log=None)
    out.append(f" total: optimizer state {_fmt_bytes(optimizer_state_bytes(params, tx))} (counters and "
               f"hyperparameters included; clip_norm={cfg.clip_norm})")
    return "\n".join(out)


__all__ = ["OptimizerConfig", "SCHEDULES", "PartitionRow", "make_schedule", "group_transforms", "build_optimizer",
           "learning_rates", "partition_rows", "optimizer_state_bytes", "partition_table"]

"""Muon as an Optax GradientTransformation, for weights stored in the Hugging Face [..., out, in] orientation.

    M ← μ M + G                       fp32 momentum buffer
    N = G + μ M  (Nesterov, default)  or N = M
    O = NewtonSchulz(N)               per matrix: every dim before the last two is a batch dim (layers, experts)
    W ← W − lr·λ·W − lr·s(m, n)·O     decoupled weight decay; s = explicit shape scale

Shape scale s for a matrix of `rows x cols` (the last two dims):
  'moonlight' (default): rms · sqrt(max(rows, cols)), rms = 0.2. Orientation-free; it gives the update the RMS of
                         an AdamW update, so Muon and AdamW share one learning rate and one weight decay.
  'keller':              sqrt(max(1, fan_out / fan_in)). Needs the orientation: with 'out_in' (PyTorch/HF, our
                         default) fan_out = rows; with 'in_out' (Flax kernels) fan_out = cols.
  'none':                1.

Differences from `optax.contrib.muon` (intended): momentum is Keller Jordan's plain sum (M = μM + G) rather than
an EMA with bias correction; only the Nesterov combination differs in direction (the EMA's bias corrections weight
G and M differently from step 2 on); eps is 1e-7; the NS iteration runs in bf16 by default; optax's Keller scale
assumes [in, out] kernels. tests/test_muon.py pins each of these.

Use under `optax.inject_hyperparams(muon)(learning_rate=schedule, ...)`: learning_rate, momentum, weight_decay,
eps and rms may be injected (they are used as traced scalars). inject_hyperparams turns every int or float
argument, defaults included, into an array, and every callable into a schedule: so ns_steps defaults to None
(= 5) and ns_dtype is a dtype name; an explicit ns_steps must be listed in `static_args`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zaya_jax.ops.newton_schulz import GRAM_IMPLS, QUINTIC_COEFFS, newton_schulz

SHAPE_SCALES = ("moonlight", "keller", "none")
ORIENTATIONS = ("out_in", "in_out")


class MuonState(NamedTuple):
    count: jax.Array  # int32 [], number of updates so far
    momentum: optax.Updates  # fp32, one buffer per parameter


def shape_scale_factor(shape, rule: str = "moonlight", *, rms=0.2, orientation: str = "out_in"):
    """The update multiplier for one matrix of `shape` [..., rows, cols]."""
    rows, cols = shape[-2], shape[-1]
    if rule == "moonlight":
        return rms * max(rows, cols) ** 0.5
    if rule == "keller":
        if orientation not in ORIENTATIONS:
            raise ValueError(f"orientation must be one of {ORIENTATIONS}, got {orientation!r}")
        fan_out, fan_in = (rows, cols) if orientation == "out_in" else (cols, rows)
        return max(1.0, fan_out / fan_in) ** 0.5
    if rule == "none":
        return 1.0
    raise ValueError(f"shape_scale must be one of {SHAPE_SCALES}, got {rule!r}")


DEFAULT_NS_STEPS = 5

# Where Newton-Schulz runs is a placement choice, not a numeric one: every matrix is orthogonalised on its own
# either way. An orthogonaliser maps (list of N-inputs, ns) -> list of outputs, ns(x) orthogonalising every
# matrix of x [..., m, n]. The default runs ns on each leaf where it is; ZeRO-1 (zaya_jax/parallel/muon_dist.py)
# installs whole-matrix ownership across the data axis while the optimizer update is traced.
_ORTHOGONALIZER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("muon_orthogonalizer",
                                                                                 default=None)


def _each_leaf(inputs, ns):
    return [ns(x) for x in inputs]


@contextlib.contextmanager
def orthogonalizer(fn: Callable):
    """Muon updates traced inside this context orthogonalise through fn(inputs, ns) -> outputs."""
    token = _ORTHOGONALIZER.set(fn)
    try:
        yield
    finally:
        _ORTHOGONALIZER.reset(token)


def _check_static(ns_steps, shape_scale, orientation, gram_impl):
    if not isinstance(ns_steps, int):
        raise TypeError("muon: ns_steps must be a Python int; under optax.inject_hyperparams pass "
                        "static_args=('ns_steps',)")
    if shape_scale not in SHAPE_SCALES:
        raise ValueError(f"muon: shape_scale must be one of {SHAPE_SCALES}, got {shape_scale!r}")
    if orientation not in ORIENTATIONS:
        raise ValueError(f"muon: orientation must be one of {ORIENTATIONS}, got {orientation!r}")
    if gram_impl not in GRAM_IMPLS:
        raise ValueError(f"muon: gram_impl must be one of {GRAM_IMPLS}, got {gram_impl!r}")


def scale_by_muon(momentum=0.95, *, nesterov: bool = True, ns_steps: int | None = None, ns_coeffs=QUINTIC_COEFFS,
                  ns_dtype: str = "bfloat16", eps=1e-7, shape_scale: str = "moonlight", rms=0.2,
                  orientation: str = "out_in", gram_impl: str = "xla") -> optax.GradientTransformation:
    """Momentum, Newton-Schulz and the shape scale: the Muon direction, without learning rate or weight decay."""
    ns_steps = DEFAULT_NS_STEPS if ns_steps is None else ns_steps
    _check_static(ns_steps, shape_scale, orientation, gram_impl)
    ns_dtype = jnp.dtype(ns_dtype)

    def init_fn(params):
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            if p.ndim < 2:
                raise ValueError(f"muon: {jax.tree_util.keystr(path)} has shape {p.shape}; Muon needs matrices "
                                 f"(route vectors to AdamW)")
        return MuonState(count=jnp.zeros([], jnp.int32),
                         momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def ns(x):
        return newton_schulz(x, steps=ns_steps, coeffs=ns_coeffs, dtype=ns_dtype, eps=eps, gram_impl=gram_impl)

    def momentum_step(g, m):
        g32 = g.astype(jnp.float32)
        m = momentum * m + g32
        return (g32 + momentum * m if nesterov else m), m

    def scaled(o, g):
        scale = shape_scale_factor(g.shape, shape_scale, rms=rms, orientation=orientation)
        return (o.astype(jnp.float32) * scale).astype(g.dtype)

    def update_fn(updates, state, params=None):
        del params
        grads, treedef = jax.tree.flatten(updates)
        stepped = [momentum_step(g, m) for g, m in zip(grads, treedef.flatten_up_to(state.momentum))]
        orthogonalize = _ORTHOGONALIZER.get() or _each_leaf
        outs = orthogonalize([n for n, _ in stepped], ns)
        new_updates = treedef.unflatten([scaled(o, g) for o, g in zip(outs, grads)])
        new_momentum = treedef.unflatten([m for _, m in stepped])
        return new_updates, MuonState(count=optax.safe_increment(state.count), momentum=new_momentum)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate: optax.ScalarOrSchedule, momentum=0.95, weight_decay=0.0,
         weight_decay_mask: Any | Callable | None = None, *, nesterov: bool = True, ns_steps: int | None = None,
         ns_coeffs=QUINTIC_COEFFS, ns_dtype: str = "bfloat16", eps=1e-7, shape_scale: str = "moonlight", rms=0.2,
         orientation: str = "out_in", gram_impl: str = "xla") -> optax.GradientTransformation:
    """Full Muon: the direction of `scale_by_muon`, decoupled weight decay, then −learning_rate."""
    return optax.chain(
        scale_by_muon(momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coeffs=ns_coeffs, ns_dtype=ns_dtype,
                      eps=eps, shape_scale=shape_scale, rms=rms, orientation=orientation, gram_impl=gram_impl),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


__all__ = ["MuonState", "SHAPE_SCALES", "ORIENTATIONS", "muon", "orthogonalizer", "scale_by_muon",
           "shape_scale_factor"]

"""PID-inspired controller of the router balancing biases (spec section 6, our [PROPOSAL]; Zyphra's exact rule is
not public).

Per layer l, once per microbatch, from the tokens routed to each class (counts [L, E+1], last = skip):
    f      = c[:E] / sum(c[:E])               load fractions of the E real experts (skip excluded)
    err    = f - 1/E                          proportional error, sums to zero
    g      = k_p * err + k_d * (err - err_prev)
    β[:E] ← AdamW step on β[:E] with gradient g (weight decay 0)  -> an overloaded expert's bias goes down
    β[:E] keeps its mean: the zero-mean part of the step is applied (no drift; a checkpoint's offsets, e.g.
                                              imported biases, are kept, and a zero learning rate changes nothing)
    β[E]   frozen at its current value (-1 at init: the skip class stays unreachable)
β itself integrates the normalised error (I), Adam's first moment is a smoothed error (P with lag), the k_d term
is the optional D. Adam's normalisation moves each bias by about `learning_rate` per step whatever the error's
size. A layer that saw no tokens is left unchanged.

The update is a pure function in fp32, outside autodiff. The caller passes counts summed over the data-parallel
group (`psum_counts` inside shard_map; under jit with a batch-sharded input the model's counts are already
global), so every rank computes identical biases. The controller state is a pytree of arrays: it checkpoints
with the rest of the train state.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    learning_rate: float = 1e-3  # bias units are probabilities (1/17 ~ 0.06)
    b1: float = 0.9
    b2: float = 0.9  # short memory: with 0.999 the large initial error dominates for ~1000 steps (measured)
    eps: float = 1e-8
    k_p: float = 1.0
    k_d: float = 0.0
    skip_bias: float = -1.0


class BalancerState(NamedTuple):
    count: jax.Array  # int32 [L], Adam steps taken per layer (layers without tokens do not step)
    mu: jax.Array  # fp32 [L, E], Adam first moment
    nu: jax.Array  # fp32 [L, E], Adam second moment
    prev_error: jax.Array  # fp32 [L, E], last load error (for the D term)


class BalanceMetrics(NamedTuple):
    max_load: jax.Array  # [L] busiest expert's share of tokens relative to uniform (1.0 = balanced)
    min_load: jax.Array  # [L] idlest expert's share relative to uniform
    max_min_ratio: jax.Array  # [L] max_load / min_load (inf when an expert got nothing)
    skip_fraction: jax.Array  # [L] share of tokens routed to the skip class (should be 0)


def init_balancer(num_layers: int, num_experts: int) -> BalancerState:
    zeros = jnp.zeros((num_layers, num_experts), jnp.float32)
    return BalancerState(count=jnp.zeros((num_layers,), jnp.int32), mu=zeros, nu=zeros, prev_error=zeros)


def initial_biases(num_layers: int, num_experts: int, skip_bias: float = -1.0) -> jax.Array:
    return jnp.zeros((num_layers, num_experts + 1), jnp.float32).at[:, -1].set(skip_bias)


def load_metrics(counts) -> BalanceMetrics:
    counts = jnp.asarray(counts, jnp.float32)
    experts, skip = counts[:, :-1], counts[:, -1]
    num_experts = experts.shape[-1]
    total = experts.sum(-1)
    share = experts / jnp.maximum(total, 1.0)[:, None] * num_experts
    max_load, min_load = share.max(-1), share.min(-1)
    ratio = jnp.where(min_load > 0, max_load / jnp.where(min_load > 0, min_load, 1.0), jnp.inf)
    return BalanceMetrics(max_load, min_load, ratio, skip / jnp.maximum(total + skip, 1.0))


def update_biases(biases, state: BalancerState, counts, cfg: BalancerConfig = BalancerConfig()):
    """biases [L, E+1], counts [L, E+1] (global over data parallel) -> (new biases, new state, metrics)."""
    biases = jax.lax.stop_gradient(jnp.asarray(biases, jnp.float32))
    counts = jax.lax.stop_gradient(jnp.asarray(counts, jnp.float32))
    experts = counts[:, :-1]
    num_experts = experts.shape[-1]
    total = experts.sum(-1, keepdims=True)
    active = total > 0  # [L, 1]
    error = experts / jnp.maximum(total, 1.0) - 1.0 / num_experts
    grad = cfg.k_p * error + cfg.k_d * (error - state.prev_error)

    count = state.count + active[:, 0].astype(jnp.int32)
    mu = cfg.b1 * state.mu + (1 - cfg.b1) * grad
    nu = cfg.b2 * state.nu + (1 - cfg.b2) * grad * grad
    t = jnp.maximum(count, 1).astype(jnp.float32)[:, None]
    step = (mu / (1 - cfg.b1**t)) / (jnp.sqrt(nu / (1 - cfg.b2**t)) + cfg.eps)
    step = step - step.mean(-1, keepdims=True)
    expert_bias = biases[:, :-1] - cfg.learning_rate * step

    expert_bias = jnp.where(active, expert_bias, biases[:, :-1])
    new_state = BalancerState(count=count, mu=jnp.where(active, mu, state.mu), nu=jnp.where(active, nu, state.nu),
                              prev_error=jnp.where(active, error, state.prev_error))
    return jnp.concatenate([expert_bias, biases[:, -1:]], axis=-1), new_state, load_metrics(counts)


def psum_counts(counts, axis_name):
    """Inside shard_map / pmap: the counts of the whole data-parallel group, identical on every rank."""
    return jax.lax.psum(counts, axis_name)


__all__ = ["BalancerConfig", "BalancerState", "BalanceMetrics", "init_balancer", "initial_biases", "load_metrics",
           "update_biases", "psum_counts"]

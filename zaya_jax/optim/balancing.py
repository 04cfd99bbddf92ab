"""The controller of the router balancing biases (spec section 6: the paper's "PID-inspired balancing scheme
enforces balance across a microbatch"; Zyphra's exact rule is not public, this one is ours).

In training every router solves, on its own microbatch, the zero-mean change delta [E] of its E expert biases after
which each expert gets the same share of the microbatch's tokens (model/routing_stats.py: balancing_correction),
selects with biases + delta (model/router.py, balance_tokens) and then makes the shares exactly equal
(model/equal_shares.py): balance is enforced within the microbatch whatever the router's probabilities look like.
After each microbatch, per layer l:

    delta  = mean over data-parallel ranks of their corrections (the routing statistics' psum)
    β[:E] ← β[:E] + learning_rate * delta         the integral term: the stored biases follow what balanced the
                                                   recent microbatches, so evaluation and inference (which select
                                                   with β alone) stay balanced and the next solve starts close
    β[E]   frozen at its current value (-1 at init: the skip class stays unreachable)

delta is zero-mean, so the mean of β[:E] (an imported checkpoint's offset) is kept, and learning_rate 0 turns the
controller off: no update and, in the train step, no in-microbatch balancing (the HF forward's selection).
Why a solve and not a step on the load error (Adam on f - 1/E, DeepSeek's sign rule): at initialisation the
router's probabilities differ between tokens by ~1e-4 or less while each optimizer step moves them by more, so
any fixed bias step is either far too coarse (one expert takes every token) or too slow to follow the router; the
per-step measurements behind this are in docs/routing.md.

The update is a pure function in fp32, outside autodiff; every rank computes identical biases from the psummed
statistics.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.model import routing_stats


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    learning_rate: float = 1.0  # share of each microbatch's balancing correction folded into the stored biases
    skip_bias: float = -1.0


class BalancerState(NamedTuple):
    count: jax.Array  # int32 [L], updates taken per layer (layers without tokens do not update)


class RoutingHealth(NamedTuple):
    """Per layer [L], from one microbatch's routing statistics."""

    max_load: jax.Array  # busiest expert's share of the tokens relative to uniform (1.0 = balanced)
    min_load: jax.Array  # idlest expert's share relative to uniform
    dead_experts: jax.Array  # experts below DEAD_LOAD of uniform
    top1_prob: jax.Array  # mean over tokens of the router's largest probability
    entropy: jax.Array  # mean softmax entropy in nats (log(E+1) = uniform)
    spread: jax.Array  # token-to-token standard deviation of the real experts' probabilities
    skip_fraction: jax.Array  # share of tokens routed to the skip class (should be 0)
    moved: jax.Array  # share of tokens that equal shares gave another expert (how far the solve left balance)


DEAD_LOAD = 0.1


def init_balancer(num_layers: int, num_experts: int) -> BalancerState:
    del num_experts
    return BalancerState(count=jnp.zeros((num_layers,), jnp.int32))


def initial_biases(num_layers: int, num_experts: int, skip_bias: float = -1.0) -> jax.Array:
    return jnp.zeros((num_layers, num_experts + 1), jnp.float32).at[:, -1].set(skip_bias)


def routing_health(stats) -> RoutingHealth:
    st = routing_stats.unpack(stats)
    experts, skip = st.counts[:, :-1], st.counts[:, -1]
    num_experts = experts.shape[-1]
    total = experts.sum(-1)
    share = experts / jnp.maximum(total, 1.0)[:, None] * num_experts
    tokens = jnp.maximum(st.tokens, 1.0)
    return RoutingHealth(share.max(-1), share.min(-1), (share < DEAD_LOAD).sum(-1).astype(jnp.float32),
                         st.top1_sum / tokens, st.entropy_sum / tokens, probability_spread(st),
                         skip / tokens, st.moved_sum / tokens)


def probability_spread(st: routing_stats.RoutingStats):
    """[L] the token-to-token standard deviation of the real experts' probabilities (root mean variance)."""
    n = jnp.maximum(st.tokens, 1.0)[:, None]
    mean = st.prob_sum[:, :-1] / n
    var = jnp.maximum(st.prob_sq_sum[:, :-1] / n - mean * mean, 0.0)
    return jnp.sqrt(var.mean(-1))


def update_biases(biases, state: BalancerState, stats, cfg: BalancerConfig = BalancerConfig()):
    """biases [L, E+1], stats [L, 4 E + 7] (summed over data parallel) -> (new biases, new state, RoutingHealth)."""
    biases = jax.lax.stop_gradient(jnp.asarray(biases, jnp.float32))
    stats = jax.lax.stop_gradient(jnp.asarray(stats, jnp.float32))
    st = routing_stats.unpack(stats)
    active = st.counts[:, :-1].sum(-1, keepdims=True) > 0  # [L, 1]
    delta = st.correction / jnp.maximum(st.ranks, 1.0)[:, None]
    expert_bias = jnp.where(active, biases[:, :-1] + cfg.learning_rate * delta, biases[:, :-1])
    new_state = BalancerState(count=state.count + active[:, 0].astype(jnp.int32))
    return jnp.concatenate([expert_bias, biases[:, -1:]], axis=-1), new_state, routing_health(stats)


def psum_stats(stats, axis_name):
    """Inside shard_map / pmap: the routing statistics of the whole data-parallel group, identical on every rank."""
    return jax.lax.psum(stats, axis_name)


__all__ = ["BalancerConfig", "BalancerState", "RoutingHealth", "DEAD_LOAD", "init_balancer", "initial_biases",
           "routing_health", "probability_spread", "update_biases", "psum_stats"]

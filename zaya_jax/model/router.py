"""The ZAYA1 router: down-projection, exponential depth averaging (EDA) of the router state across layers,
RMSNorm + two exact-GELU MLP layers + out_proj to E+1 classes (the last is the skip class), softmax, balancing
biases added to the probabilities for selection only, top-1 with the un-renormalised probability as the weight (in
the train step, of the expert that the balancing gave the token).
Runs in fp32 whatever the compute dtype (argmax ties must not depend on bf16 rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model import routing_stats
from zaya_jax.model.base import BalancingBias, Linear, RMSNormWeight, activation
from zaya_jax.model.equal_shares import equal_shares
from zaya_jax.ops.rmsnorm import rms_norm_reference


class RouterMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        R = cfg.router_hidden_size
        self.norm = RMSNormWeight(cfg, R)
        self.fc1 = Linear(cfg, R, R, bias=True, rngs=rngs)
        self.fc2 = Linear(cfg, R, R, bias=True, rngs=rngs)
        self.out_proj = Linear(cfg, R, cfg.num_experts + 1, bias=False, rngs=rngs)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.down_proj = Linear(cfg, cfg.hidden_size, cfg.router_hidden_size, bias=True, rngs=rngs)
        self.router_mlp = RouterMLP(cfg, rngs)
        init = jnp.zeros((cfg.num_experts + 1,), jnp.float32).at[-1].set(-1.0)
        self.balancing_biases = BalancingBias(init)
        # set by the train step (set_attributes): solve_balance computes the balancing correction for the bias
        # controller's statistics, balance_tokens also selects with it; neither in evaluation or generation
        self.solve_balance = False
        self.balance_tokens = False

    def __call__(self, x, prev_state, state_scale, token_mask=None):
        """x: [B,T,D]; prev_state: [B,T,R] fp32 (zeros at layer 0); state_scale: [R] (ones at layer 0).
        Returns (weight [B,T] fp32, index [B,T] int32 in [0, E], router state for the next layer, probabilities
        [B,T,E+1] fp32, the balancing correction [E] of these tokens, moved [B,T] bool). With balance_tokens the
        selection adds the correction of routing_stats.balancing_correction to the biases, which brings every expert
        near an equal share of this forward's tokens (the controller folds it into the biases, optim/balancing.py),
        and model/equal_shares.py then makes the shares equal, moving the tokens it marks in `moved`; without
        balance_tokens or solve_balance the correction is zero and no token moves."""
        cfg = self.cfg
        f32 = jnp.float32
        gelu = activation("gelu")
        u = self.down_proj(x, f32) + prev_state * state_scale.astype(f32)
        mlp = self.router_mlp
        z = rms_norm_reference(u, mlp.norm.weight[...], cfg.rms_norm_eps, f32)
        z = gelu(mlp.fc1(z, f32))
        z = gelu(mlp.fc2(z, f32))
        probs = jax.nn.softmax(mlp.out_proj(z, f32), axis=-1)
        score = jax.lax.stop_gradient(probs) + self.balancing_biases[...].astype(f32)
        valid = jnp.ones(x.shape[:-1], bool) if token_mask is None else token_mask.astype(bool)
        expert_scores = score[..., :-1].reshape(-1, cfg.num_experts)
        if self.solve_balance or self.balance_tokens:
            correction = routing_stats.balancing_correction(expert_scores, valid.reshape(-1), cfg.solve_impl)
        else:  # zeros that vary like the scores inside shard_map
            correction = expert_scores[0] * 0.0
        if self.balance_tokens:
            score = score + jnp.append(correction, 0.0)
        index = jnp.argmax(score, axis=-1).astype(jnp.int32)
        moved = jnp.zeros(index.shape, bool)
        if self.balance_tokens:
            index, moved = equal_shares(score[..., :-1].reshape(-1, cfg.num_experts), index.reshape(-1),
                                        valid.reshape(-1), cfg.solve_impl)
            index = checkpoint_name(index.reshape(valid.shape), routing_stats.SELECTION_NAME)
            moved = moved.reshape(valid.shape)
        weight = jnp.take_along_axis(probs, index[..., None], axis=-1)[..., 0]
        return weight, index, u, probs, correction, moved

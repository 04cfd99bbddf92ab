"""One ZAYA1 decoder layer: pre-norm CCA block and pre-norm MoE block, each merged into the fp32 residual
stream through learned residual scaling."""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.base import ResidualScaling, RMSNormWeight, dtypes
from zaya_jax.model.cca import CCAttention
from zaya_jax.model import routing_stats
from zaya_jax.model.experts import Experts
from zaya_jax.model.router import Router
from zaya_jax.ops import rmsnorm as norm_ops


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate = Router(cfg, rngs)
        self.experts = Experts(cfg, rngs)

    def __call__(self, x, router_state, state_scale, token_mask=None):
        B, T, D = x.shape
        weight, index, router_state, probs, correction, moved = self.gate(x, router_state, state_scale, token_mask)
        out = self.experts(x.reshape(B * T, D), index.reshape(-1), weight.reshape(-1)).reshape(B, T, D)
        return out, router_state, routing_stats.token_sums(probs, index, correction, moved, token_mask)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.input_layernorm = RMSNormWeight(cfg, cfg.hidden_size)
        self.self_attn = CCAttention(cfg, rngs)
        self.post_attention_residual_scale = ResidualScaling(cfg)
        self.post_attention_layernorm = RMSNormWeight(cfg, cfg.hidden_size)
        self.mlp = MoE(cfg, rngs)
        self.post_mlp_residual_scale = ResidualScaling(cfg)

    def __call__(self, h, router_state, **kw):
        """h: fp32 residual [B,T,D]. Returns (h, router_state, routing statistics (model/routing_stats.py), CCA
        state at chunk end)."""
        cfg = self.cfg
        x = norm_ops.rms_norm(h, self.input_layernorm.weight[...], cfg.rms_norm_eps, dtypes(cfg)[0],
                              impl=cfg.norm_impl)
        h, m, router_state, stats, cca_state = self.blocks(h, x, router_state, **kw)
        h = norm_ops.residual_merge_reference(m, h, *self.post_mlp_residual_scale.vectors())
        return h, router_state, stats, cca_state

    def blocks(self, h, x, router_state, *, state_scale, positions, inv_freq, sliding_window=None,
               attention_mask=None, cca_state=None, attend=None, segment_ids=None, cca_exchange=None):
        """The layer short of its last residual merge, from h and x = input_layernorm(h): returns (h after the
        attention block, the MoE output m, router_state, routing statistics, cca_state). The unrolled model merges m
        into h fused with the next norm (ZayaModel)."""
        cfg = self.cfg
        dt, eps, impl = dtypes(cfg)[0], cfg.rms_norm_eps, cfg.norm_impl
        a, cca_state = self.self_attn(x, positions=positions, inv_freq=inv_freq, sliding_window=sliding_window,
                                      attention_mask=attention_mask, state=cca_state, attend=attend,
                                      segment_ids=segment_ids, cca_exchange=cca_exchange)
        a = checkpoint_name(a, "attention_out")
        h, x = norm_ops.merge_rms_norm(a, h, *self.post_attention_residual_scale.vectors(),
                                       self.post_attention_layernorm.weight[...], eps, dt, impl=impl)
        m, router_state, stats = self.mlp(x, router_state, state_scale, attention_mask)
        return h, m, router_state, stats, cca_state

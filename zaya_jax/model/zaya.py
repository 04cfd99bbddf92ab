"""ZayaModel (embedding, input scaling, scanned decoder layers, final norm) and ZayaForCausalLM (tied head).

Decoder layers are created with stacked parameters (leading axis = layer) and run under `jax.lax.scan` with a
configurable remat policy, or unrolled (scan_layers=False; per-layer slices from model/layer_stack.py, each layer's
last residual merge fused with the next norm in one merge_rms_norm); per-layer
differences (EDA scale, RoPE frequencies, sliding window) travel as scan inputs. The EDA router state and the fp32
residual stream are the scan carry.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model import embedding_tap, routing_stats
from zaya_jax.model.base import RMSNormWeight, dtypes, normal_init
from zaya_jax.model.layer import DecoderLayer
from zaya_jax.model.layer_stack import LayerSlices, holds_layer_slices, unstack_layers
from zaya_jax.model.loss import head_logits
from zaya_jax.ops import rmsnorm as norm_ops
from zaya_jax.ops.qk_norm_rope import rope_inv_freq

_FULL_WINDOW = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass
class ForwardAux:
    router_stats: jax.Array  # [L, 3 (E+1) + 2] per-layer routing sums over the counted tokens (model/routing_stats.py)

    @property
    def expert_counts(self) -> jax.Array:
        """[L, E+1] tokens routed to each class (last = skip) per layer, padding excluded."""
        return routing_stats.unpack(self.router_stats).counts


jax.tree_util.register_dataclass(ForwardAux, data_fields=["router_stats"], meta_fields=[])

# Every policy keeps the routers' balancing corrections ([E] per layer) and the train step's final experts ([N] per
# layer): the backward's recomputation reuses them instead of solving and sharing out again (model/routing_stats.py,
# model/equal_shares.py).
_KEEP_CORRECTION = jax.checkpoint_policies.save_only_these_names(routing_stats.CORRECTION_NAME,
                                                                 routing_stats.SELECTION_NAME)
_REMAT = {name: jax.checkpoint_policies.save_from_both_policies(policy, _KEEP_CORRECTION) for name, policy in {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
}.items()}


class Embedding(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        w = normal_init(cfg)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtypes(cfg)[1])
        if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size:
            w = w.at[cfg.pad_token_id].set(0)  # HF zero-initialises the padding row
        self.weight = nnx.Param(w)


class ZayaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        _, pdt = dtypes(cfg)
        D, L = cfg.hidden_size, cfg.num_hidden_layers
        self.embed_tokens = Embedding(cfg, rngs)
        self.input_hidden_states_scale = nnx.Param(jnp.ones((D,), pdt))
        self.input_hidden_states_bias = nnx.Param(jnp.zeros((D,), pdt))
        # EDA scale of layers 1..L-1 (layer 0 has none); stacked here so every scanned layer has one structure.
        self.router_states_scale = nnx.Param(jnp.ones((L - 1, cfg.router_hidden_size), pdt))

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return DecoderLayer(cfg, rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNormWeight(cfg, D)

    def _per_layer_inputs(self):
        cfg = self.cfg
        inv_freq = jnp.stack([rope_inv_freq(cfg.rope[t].theta, cfg.rotary_dim) for t in cfg.layer_types])
        ones = jnp.ones((1, cfg.router_hidden_size), self.router_states_scale[...].dtype)
        state_scale = jnp.concatenate([ones, self.router_states_scale[...]], axis=0)
        windows = None
        if "hybrid_sliding" in cfg.layer_types:
            windows = jnp.array([cfg.sliding_window if t == "hybrid_sliding" else _FULL_WINDOW
                                 for t in cfg.layer_types], jnp.int32)
        return state_scale, inv_freq, windows

    def _window_arg(self, window):
        """A layer's sliding window: the config's int when every layer slides (static, so attention can skip the
        tiles outside it), else the layer's traced value from _per_layer_inputs (None when no layer slides)."""
        cfg = self.cfg
        return cfg.sliding_window if set(cfg.layer_types) == {"hybrid_sliding"} else window

    def _embed(self, input_ids):
        """The fp32 residual stream's start: scaled input embeddings [B, T, D]."""
        e = embedding_tap.lookup(self.embed_tokens.weight.get_value(), input_ids)
        return (e + self.input_hidden_states_bias[...].astype(jnp.float32)) * self.input_hidden_states_scale[
            ...].astype(jnp.float32)

    def _norm_chain(self, h, layers):
        """(the first layer's normed input, [the norm weight after each layer]) for the unrolled forwards, which
        fuse each layer's last residual merge with the norm after it: the next layer's input norm, the final last."""
        cfg = self.cfg
        norms = [layer.input_layernorm.weight[...] for layer in layers]
        x = norm_ops.rms_norm(h, norms[0], cfg.rms_norm_eps, dtypes(cfg)[0], impl=cfg.norm_impl)
        return x, norms[1:] + [self.norm.weight[...]]

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *, attend=None,
                 cca_exchange=None):
        """Returns (final normed hidden states [B,T,D] in the compute dtype, ForwardAux).

        positions: RoPE positions (default 0..T-1); segment_ids: packed documents that must not see each other
        (attention, convolutions and the value shift all restart at a document start). attend / cca_exchange:
        the context-parallel attention and CCA boundary exchange (zaya_jax/parallel/context.py), every layer."""
        cfg = self.cfg
        dt = dtypes(cfg)[0]
        B, T = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        h = self._embed(input_ids)
        # zeros_like(h): under shard_map (context parallelism) the scan carry must vary over the mesh axes as h does
        router_state = jnp.zeros_like(h, shape=(B, T, cfg.router_hidden_size))
        state_scale, inv_freq, windows = self._per_layer_inputs()
        graphdef, layer_state = nnx.split(self.layers)

        def layer_kwargs(scale, freq, window):
            return dict(state_scale=scale, positions=positions, inv_freq=freq, sliding_window=self._window_arg(window),
                        attention_mask=attention_mask, segment_ids=segment_ids, attend=attend,
                        cca_exchange=cca_exchange)

        def body(carry, xs):
            h, r = carry
            params, scale, freq, window = xs
            h, r, counts, _ = nnx.merge(graphdef, params)(h, r, **layer_kwargs(scale, freq, window))
            return (h, r), counts

        def unrolled_body(carry, xs):
            """One layer whose last residual merge is fused with the next norm (the next layer's input norm, or
            the final one): one pass over the fp32 residual instead of two, and the merge's backward in the
            norm kernel instead of XLA's reductions."""
            h, x, r = carry
            params, scale, freq, window, next_norm = xs
            layer = nnx.merge(graphdef, params)
            h, m, r, counts, _ = layer.blocks(h, x, r, **layer_kwargs(scale, freq, window))
            h, x = norm_ops.merge_rms_norm(m, h, *layer.post_mlp_residual_scale.vectors(), next_norm,
                                           cfg.rms_norm_eps, dt, impl=cfg.norm_impl)
            return (h, x, r), counts

        if cfg.remat != "none":
            remat = functools.partial(jax.checkpoint, policy=_REMAT[cfg.remat], prevent_cse=not cfg.scan_layers)
            body, unrolled_body = remat(body), remat(unrolled_body)
        xs = (layer_state, state_scale, inv_freq, windows)
        if cfg.scan_layers:
            if holds_layer_slices(layer_state):
                raise ValueError("a per-layer parameter view (model/compute_view.py, per_layer=True) needs the "
                                 "layers unrolled (scan_layers=False); lax.scan reads them stacked")
            (h, _), counts = jax.lax.scan(body, (h, router_state), xs)
            y = norm_ops.rms_norm(h, self.norm.weight[...], cfg.rms_norm_eps, dt, impl=cfg.norm_impl)
            return y, ForwardAux(router_stats=counts)
        per_layer = unstack_layers(xs, cfg.num_hidden_layers)
        x, next_norms = self._norm_chain(h, [nnx.merge(graphdef, layer_xs[0]) for layer_xs in per_layer])
        carry, counts = (h, x, router_state), []
        for layer_xs, next_norm in zip(per_layer, next_norms):
            carry, c = unrolled_body(carry, (*layer_xs, next_norm))
            counts.append(c)
        return carry[1], ForwardAux(router_stats=jnp.stack(counts))

    def forward_with_layer_state(self, input_ids, *, positions, cca_state, attend_state, attend,
                                 attention_mask=None, cca_slot=None):
        """The forward for inference caches: each layer reads and returns its own part of per-layer state.

        cca_state: CCAState whose leaves have a leading layer axis ([L, B, P, C] halo, [L, B, KV*d/2] value), or
        with cca_slot (the chunk's first cache slot) a halo ring by slot ([L, B, P + 1, C]: model/cca.py);
        attend_state: any pytree with a leading layer axis (e.g. K/V caches); attend(attend_state_l, q, k, v,
        sliding_window) -> (o, new attend_state_l) replaces the layer's attention. attention_mask [B, T] zeroes
        padded tokens before the CCA projections (as HF does for multi-token inputs).
        Returns (final normed hidden states [B, T, D], new cca_state, new attend_state), the layer axis held as
        LayerSlices. The layers run unrolled, without remat (this path is never differentiated): parameters and
        state held as LayerSlices (model/compute_view.py per_layer, inference/cache.py) are read and written in
        place, where a layer scan would copy each layer's slice of the stacked arrays on every call. As in the
        unrolled forward, each layer's last residual merge is fused with the next norm: in a single-token step
        every pass over the residual is a kernel launch of its own."""
        cfg = self.cfg
        dt = dtypes(cfg)[0]
        B, T = input_ids.shape
        h = self._embed(input_ids)
        r = jnp.zeros((B, T, cfg.router_hidden_size), jnp.float32)
        state_scale, inv_freq, windows = self._per_layer_inputs()
        graphdef, layer_params = nnx.split(self.layers)
        xs = (layer_params, state_scale, inv_freq, windows, cca_state, attend_state)
        per_layer = unstack_layers(xs, cfg.num_hidden_layers)
        layers = [nnx.merge(graphdef, layer_xs[0]) for layer_xs in per_layer]
        x, next_norms = self._norm_chain(h, layers)
        produced = []
        for layer, (_, scale, freq, window, cca_l, attend_l), next_norm in zip(layers, per_layer, next_norms):
            window_arg = self._window_arg(window)
            new_attend = {}

            def layer_attend(q, k, v, attend_l=attend_l, window_arg=window_arg, new_attend=new_attend):
                o, new_attend["state"] = attend(attend_l, q, k, v, window_arg)
                return o

            h, m, r, _, cca_l = layer.blocks(h, x, r, state_scale=scale, positions=positions, inv_freq=freq,
                                             sliding_window=window_arg, attention_mask=attention_mask,
                                             cca_state=dataclasses.replace(cca_l, slot=cca_slot),
                                             attend=layer_attend)
            h, x = norm_ops.merge_rms_norm(m, h, *layer.post_mlp_residual_scale.vectors(), next_norm,
                                           cfg.rms_norm_eps, dt, impl=cfg.norm_impl)
            produced.append((dataclasses.replace(cca_l, slot=None), new_attend["state"]))
        cca_state, attend_state = jax.tree.map(lambda *layers: LayerSlices(layers), *produced)
        return x, cca_state, attend_state


class LMHead(nnx.Module):
    """The untied head weight and/or the head bias (HF keeps lm_head.bias even when the weight is tied)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        self.weight = None if cfg.tie_word_embeddings else nnx.Param(
            normal_init(cfg)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdt))
        self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), pdt)) if cfg.lm_head_bias else None


class ZayaForCausalLM(nnx.Module):
    """model(input_ids, attention_mask=None) -> fp32 logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None = None, *, seed: int = 0):
        rngs = rngs if rngs is not None else nnx.Rngs(seed)
        self.cfg = cfg
        self.model = ZayaModel(cfg, rngs)
        self.lm_head = LMHead(cfg, rngs) if not cfg.tie_word_embeddings or cfg.lm_head_bias else None

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None):
        return self.forward(input_ids, attention_mask, positions, segment_ids)[0]

    def forward(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *, attend=None,
                cca_exchange=None):
        """Returns (fp32 logits, ForwardAux). attend / cca_exchange: context parallelism (see ZayaModel)."""
        y, aux = self.model(input_ids, attention_mask, positions, segment_ids, attend=attend,
                            cca_exchange=cca_exchange)
        return self.logits(y), aux

    def head_weight(self):
        if self.cfg.tie_word_embeddings:
            return embedding_tap.table(self.model.embed_tokens.weight.get_value())
        return self.lm_head.weight[...]

    def head_weight_copy(self):
        """The tied head's table already in the compute dtype, when a tap carries it (else None)."""
        if self.cfg.tie_word_embeddings:
            return embedding_tap.head_copy(self.model.embed_tokens.weight.get_value())
        return None

    def logits(self, y):
        """fp32 logits from final hidden states, rounded once to the compute dtype as HF's lm_head returns them."""
        bias = self.lm_head.bias[...] if self.lm_head is not None and self.lm_head.bias is not None else None
        return head_logits(y, self.head_weight(), bias).astype(jnp.float32)

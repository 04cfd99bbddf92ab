"""Prefill and single-token decode over a DecodeCache, jit-compiled with the cache donated.

    decoder = Decoder(model)
    cache = decoder.init_cache(batch=2, max_length=128)
    logits, cache = decoder.prefill(cache, ids, mask)     # [B, V] logits of each row's last prompt token
    logits, cache = decoder.step(cache, next_tokens)      # [B, V] for the token just fed

Both calls consume `cache` (its buffers are donated): use the returned one. A chunk that does not fit in the
cache returns NaN logits instead of silently overwriting old slots.

A Decoder holds its own copy of the weights (the inference view); decoders and scorers of one model can share one:

    shared = inference_state(model)
    decoder, scorer = Decoder(model, state=shared), Scorer(model, max_length=2048, state=shared)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.inference.cache import (
    DecodeCache,
    advance,
    cached_attention,
    chunk_positions,
    init_cache,
)
from zaya_jax.inference.kernels import with_kernels
from zaya_jax.model.base import Linear
from zaya_jax.model.compute_view import inference_view
from zaya_jax.model.zaya import ZayaForCausalLM


def extend(model: ZayaForCausalLM, cache: DecodeCache, input_ids, token_mask=None, *, all_logits: bool = True):
    """Runs a chunk [B, T] (T >= 1, token_mask [B, T] 1 = real token, None = all real) through the model on top
    of `cache`. Returns (fp32 logits [B, T, V], or [B, 1, V] for the last position only, and the cache including
    the chunk)."""
    B, T = input_ids.shape
    all_real = token_mask is None
    token_mask = jnp.ones((B, T), bool) if all_real else token_mask.astype(bool)
    positions = chunk_positions(cache, token_mask)
    attend, kv_valid = cached_attention(cache, token_mask, model.cfg.attention_impl)
    # HF zeroes padded tokens before the CCA projections only for multi-token chunks with padding
    conv_mask = None if all_real or T == 1 else token_mask
    y, cca, kv = model.model.forward_with_layer_state(input_ids, positions=positions, cca_state=cache.cca,
                                                      attend_state=cache.kv, attend=attend,
                                                      attention_mask=conv_mask, cca_slot=cache.index)
    logits = model.logits(y if all_logits else y[:, -1:])  # a long prompt's [T, vocab] logits are large
    fits = cache.index + T <= cache.max_length
    logits = jnp.where(fits, logits, jnp.nan)
    return logits, advance(cache, kv, cca, kv_valid, token_mask)


class Decoder:
    """Jitted prefill/step for one model; the parameters are arguments (not constants) of every compiled call.

    kernels: None (the model's impls), 'auto', 'xla' or 'gpu' (inference/kernels.py): prefill compiles with the
    'prefill' choice (graphdef), single-token steps and bound loops with the 'decode' one (step_graphdef); both
    read the same parameters (state).

    The decoder holds each layer's weights as their own arrays (model/compute_view.py, LayerSlices: a copy of the
    model's layer weights, made once), so that every step reads them in place; a scan over the stacked weights
    copies each layer's slice in every step (docs/experiments.md)."""

    def __init__(self, model: ZayaForCausalLM, *, kernels: str | None = None, state: nnx.State | None = None):
        """state: inference_state(model), to share one copy of the weights with other Decoders and Scorers of
        `model` (by default the decoder makes its own)."""
        self.cfg = model.cfg
        model = with_fused_projections(model)
        self.graphdef, own = nnx.split(with_kernels(model, kernels, "prefill"))
        self.state = reader_state(own, state)
        self.step_graphdef = nnx.split(with_kernels(model, kernels, "decode"))[0]
        self._prefill = jax.jit(functools.partial(_prefill, self.graphdef), donate_argnums=1,
                                static_argnames="all_logits")
        self._step = jax.jit(functools.partial(_step, self.step_graphdef), donate_argnums=1)
        self._init = jax.jit(functools.partial(_init, self.graphdef), static_argnums=(1, 2))
        self._bound = {}

    def bind(self, fn, **jit_options):
        """jax.jit(fn with this model's decode graphdef as first argument), compiled once per decoder: fn(graphdef,
        state, ...) builds the model inside the trace (the graphdef holds the config, which is not hashable) and
        runs single-token steps (the generation loop)."""
        if fn not in self._bound:
            self._bound[fn] = jax.jit(functools.partial(fn, self.step_graphdef), **jit_options)
        return self._bound[fn]

    def init_cache(self, batch: int, max_length: int) -> DecodeCache:
        return self._init(self.state, batch, max_length)

    def prefill(self, cache: DecodeCache, input_ids, attention_mask=None, *, all_logits: bool = False):
        """Left-padded prompts [B, T] (attention_mask 1 = real token). Returns (logits, cache): [B, V] for the
        last position, or [B, T, V] with all_logits."""
        ids = jnp.asarray(input_ids, jnp.int32)
        mask = None if attention_mask is None else jnp.asarray(attention_mask, bool)
        return self._prefill(self.state, cache, ids, mask, all_logits=all_logits)

    def step(self, cache: DecodeCache, tokens):
        """One new token per row [B]. Returns (logits [B, V], cache)."""
        return self._step(self.state, cache, jnp.asarray(tokens, jnp.int32))


def inference_state(model: ZayaForCausalLM) -> nnx.State:
    """The weights a Decoder and a Scorer of `model` read (its fused q/k/v projection, the per-layer inference view of
    model/compute_view.py): a copy of the model's weights, which each of them otherwise makes for itself. Pass it as
    their `state=` to hold one copy for all (an lm-eval run that scores and generates, a benchmark of both)."""
    return inference_view(nnx.split(with_fused_projections(model))[1])


def reader_state(own: nnx.State, state: nnx.State | None) -> nnx.State:
    """What a Decoder or Scorer reads, given its split of the fused model (`own`): its own inference view of it, or
    the shared `state` if that has the paths, shapes and dtypes of the view (worked out abstractly, nothing copied);
    else a ValueError naming the first difference."""
    if state is None:
        return inference_view(own)
    expected = jax.tree_util.tree_flatten_with_path(jax.eval_shape(inference_view, own))[0]
    given = jax.tree_util.tree_flatten_with_path(state)[0]
    if len(expected) != len(given):
        raise ValueError(f"state= is not inference_state(model) of this model: {len(given)} arrays, not "
                         f"{len(expected)}")
    for (path, want), (given_path, have) in zip(expected, given):
        if path != given_path or (want.shape, want.dtype) != (jnp.shape(have), jnp.result_type(have)):
            raise ValueError(f"state= is not inference_state(model) of this model: at "
                             f"{jax.tree_util.keystr(path)} it needs {want.dtype}{list(want.shape)}, got "
                             f"{jax.tree_util.keystr(given_path)} {jnp.result_type(have)}{list(jnp.shape(have))}")
    return state


def with_fused_projections(model: ZayaForCausalLM) -> ZayaForCausalLM:
    """A copy of `model` (its arrays shared) whose CCA projections hold the four q/k/v weights concatenated
    (CCAProjection.fused): one GEMV per layer and step instead of four, and an output whose q and k columns the
    convolution reads in place (the Decoder and the Scorer use it). The concatenation is each output column's
    own dot product, so the values are those of the four. The q, k and current-value Linears are dropped (nothing
    else reads them); the delayed-value one stays for the cache's first delayed value (its bias)."""
    clone = nnx.merge(*nnx.split(model))
    proj = clone.model.layers.self_attn.qkv_proj
    parts = [proj.q_proj, proj.k_proj, proj.v_proj_current, proj.v_proj_delayed]
    fused = Linear(clone.cfg, 1, 1, bias=proj.q_proj.bias is not None, rngs=nnx.Rngs(0))
    fused.weight = nnx.Param(jnp.concatenate([p.weight[...] for p in parts], axis=-2))  # [L, out, in]
    if fused.bias is not None:
        fused.bias = nnx.Param(jnp.concatenate([p.bias[...] for p in parts], axis=-1))
    proj.fused = nnx.data(fused)
    del proj.q_proj, proj.k_proj, proj.v_proj_current
    return clone


def _init(graphdef, state, batch, max_length):
    return init_cache(nnx.merge(graphdef, state), batch, max_length)


def _prefill(graphdef, state, cache, ids, mask, *, all_logits):
    logits, cache = extend(nnx.merge(graphdef, state), cache, ids, mask, all_logits=all_logits)
    return (logits if all_logits else logits[:, 0]), cache


def _step(graphdef, state, cache, tokens):
    logits, cache = extend(nnx.merge(graphdef, state), cache, tokens[:, None])
    return logits[:, 0], cache

"""The jitted training and evaluation steps (pure functions of the train state and a batch).

One call = one microbatch: forward, next-token loss, backward, the optimizer (which accumulates micro-gradients
and applies them every k calls when accumulation is on), and the balancing-bias controller, which runs once per
microbatch on the expert counts of the whole data-parallel batch (global under jit), outside autodiff.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zaya_jax.model.loss import chunked_head_cross_entropy, token_cross_entropy_terms
from zaya_jax.optim.balancing import BalancerConfig, update_biases
from zaya_jax.parallel.context import ContextParallel

BIASES_PATH = ("model", "layers", "mlp", "gate", "balancing_biases")


def get_biases(model_state):
    node = model_state
    for k in BIASES_PATH:
        node = node[k]
    return node


def with_biases(model_state, biases):
    def rebuild(node, keys):
        if not keys:
            return biases
        return {**node, keys[0]: rebuild(node[keys[0]], keys[1:])}
    return rebuild(model_state, BIASES_PATH)


def model_inputs(batch: dict, reset_at_documents: bool) -> dict:
    if not reset_at_documents:
        return {}
    return {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}


def loss_mask(batch: dict, reset_at_documents: bool):
    """Which targets count: all of them, Megatron's default, or (with document resets) not the first token of the
    next document; padding rows of eval batches (source_id -1) never count."""
    mask = batch["loss_mask"] if reset_at_documents else jnp.ones_like(batch["loss_mask"])
    return mask * (batch["source_ids"][:, None] >= 0)


def loss_sums(model, batch, reset_at_documents: bool, ce_chunk_tokens: int | None = None):
    """(sum of token losses, counted tokens, expert counts) of a batch. ce_chunk_tokens: run the vocabulary head and
    the cross-entropy in chunks of this many tokens, gradients formed per chunk (model/loss.py:
    chunked_head_cross_entropy; never holds the [B, T, V] fp32 logits)."""
    extra, mask = model_inputs(batch, reset_at_documents), loss_mask(batch, reset_at_documents)
    if ce_chunk_tokens:
        hidden, aux = model.model(batch["inputs"], **extra)
        bias = model.lm_head.bias[...] if model.lm_head is not None and model.lm_head.bias is not None else None
        total, counted = chunked_head_cross_entropy(hidden, model.head_weight(), batch["targets"], mask, bias=bias,
                                                    chunk_tokens=ce_chunk_tokens)
        return total, counted, aux.expert_counts
    logits, aux = model.forward(batch["inputs"], **extra)
    terms, counted = token_cross_entropy_terms(logits, batch["targets"], mask)
    return terms.sum(), counted.sum(), aux.expert_counts


def make_loss_fn(graphdef, reset_at_documents: bool, *, ce_chunk_tokens: int | None = None):
    def loss_fn(params, model_state, batch):
        total, counted, counts = loss_sums(nnx.merge(graphdef, params, model_state), batch, reset_at_documents,
                                           ce_chunk_tokens)
        return total / jnp.maximum(counted, 1.0), counts
    return loss_fn


def make_local_loss_sums(graphdef, reset_at_documents: bool, cp: ContextParallel | None = None,
                         ce_chunk_tokens: int | None = None):
    """make_loss_fn's loss as per-device sums, for data/context parallelism in shard_map
    (zaya_jax/parallel/data_parallel.py): (sum of token losses, counted tokens, expert counts) of this device's
    rows; with cp, of its zigzag share of their tokens (zaya_jax/parallel/context.py; full logits there)."""

    def local_sums(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state)
        if cp is None:
            return loss_sums(model, batch, reset_at_documents, ce_chunk_tokens)
        extra = model_inputs(batch, reset_at_documents)
        logits, aux = cp.local_forward(model, batch["inputs"], extra.get("positions"), extra.get("segment_ids"))
        batch = {k: cp.rows(v) for k, v in batch.items()}
        terms, counted = token_cross_entropy_terms(logits, batch["targets"], loss_mask(batch, reset_at_documents))
        return terms.sum(), counted.sum(), aux.expert_counts

    return local_sums


def make_train_step(graphdef, tx: optax.GradientTransformation, balancer: BalancerConfig, *,
                    reset_at_documents: bool = False, ce_chunk_tokens: int | None = None, grad_fn=None):
    """grad_fn(params, model_state, batch) -> ((loss, expert counts), grads) replaces value_and_grad of the model
    loss (data/context parallelism in shard_map plugs in here: zaya_jax/parallel/data_parallel.py)."""
    grad_fn = grad_fn or jax.value_and_grad(make_loss_fn(graphdef, reset_at_documents,
                                                         ce_chunk_tokens=ce_chunk_tokens), has_aux=True)

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array]):
        (loss, counts), grads = grad_fn(state["params"], state["model_state"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        biases, balancer_state, load = update_biases(get_biases(state["model_state"]), state["balancer"], counts,
                                                     balancer)
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
                     "model_state": with_biases(state["model_state"], biases), "balancer": balancer_state}
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "max_load": jnp.max(load.max_load),
                   "min_load": jnp.min(load.min_load), "skip_fraction": jnp.max(load.skip_fraction)}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, num_sources: int, *, reset_at_documents: bool = False):
    """Summed loss and token count per source (rows with source_id -1 are padding)."""

    def eval_step(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state)
        logits, _ = model.forward(batch["inputs"], **model_inputs(batch, reset_at_documents))
        terms, counted = token_cross_entropy_terms(logits, batch["targets"], loss_mask(batch, reset_at_documents))
        onehot = jax.nn.one_hot(batch["source_ids"], num_sources, dtype=jnp.float32)  # -1 -> zero row
        return onehot.T @ terms.sum(-1), onehot.T @ counted.sum(-1)

    return eval_step

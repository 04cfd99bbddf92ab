"""The jitted training and evaluation steps (pure functions of the train state and a batch).

One call of the accumulating train step = one optimizer step over k microbatches stacked on a leading axis: per
microbatch (a lax.scan) forward, next-token loss, backward and the balancing-bias controller, which runs on that
microbatch's expert counts of the whole data-parallel batch (global under jit), outside autodiff, so the next
microbatch routes with the updated biases; the micro-gradients summed in fp32 in the scan carry; then one optimizer
update with their mean. Accumulating inside one program keeps the per-microbatch work to the gradient and one fp32
add: an optimizer-side accumulator (optax.MultiSteps-style, one call per microbatch) also paid state-sized passes
per microbatch (zero updates, params + 0, the accumulator's bookkeeping) and measured clearly slower over 16
microbatches (docs/experiments.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zaya_jax.model import deferred_wgrad, embedding_tap
from zaya_jax.model.compute_view import compute_view, tree_get, tree_replace
from zaya_jax.model.layer_stack import stack_layer_slices
from zaya_jax.model.loss import chunked_head_cross_entropy, token_cross_entropy_terms
from zaya_jax.ops import grouped_matmul as gmm
from zaya_jax.optim.balancing import BalancerConfig, update_biases
from zaya_jax.parallel.context import ContextParallel

BIASES_PATH = ("model", "layers", "mlp", "gate", "balancing_biases")


def get_biases(model_state):
    return tree_get(model_state, BIASES_PATH)


def with_biases(model_state, biases):
    return tree_replace(model_state, BIASES_PATH, biases)


def model_inputs(batch: dict, reset_at_documents: bool) -> dict:
    if not reset_at_documents:
        return {}
    return {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}


def loss_mask(batch: dict, reset_at_documents: bool):
    """Which targets count: all of them, Megatron's default, or (with document resets) not the first token of the
    next document; padding rows of eval batches (source_id -1) never count."""
    mask = batch["loss_mask"] if reset_at_documents else jnp.ones_like(batch["loss_mask"])
    return mask * (batch["source_ids"][:, None] >= 0)


def loss_sums(model, batch, reset_at_documents: bool, ce_chunk_tokens: int | None = None, *, mean: bool = False):
    """(sum of token losses, counted tokens, expert counts) of a batch; with mean, the token mean instead of the
    sum. ce_chunk_tokens: run the vocabulary head and the cross-entropy in chunks of this many tokens, gradients
    formed per chunk (model/loss.py: chunked_head_cross_entropy, whose `mean` leaves the head gradient final in the
    forward; never holds the [B, T, V] fp32 logits)."""
    extra, mask = model_inputs(batch, reset_at_documents), loss_mask(batch, reset_at_documents)
    if ce_chunk_tokens:
        hidden, aux = model.model(batch["inputs"], **extra)
        bias = model.lm_head.bias[...] if model.lm_head is not None and model.lm_head.bias is not None else None
        total, counted = chunked_head_cross_entropy(hidden, model.head_weight(), batch["targets"], mask, bias=bias,
                                                    chunk_tokens=ce_chunk_tokens, impl=model.cfg.ce_impl, mean=mean,
                                                    weight_compute=model.head_weight_copy())
        return total, counted, aux.router_stats
    logits, aux = model.forward(batch["inputs"], **extra)
    terms, counted = token_cross_entropy_terms(logits, batch["targets"], mask)
    total, counted = terms.sum(), counted.sum()
    return (total / jnp.maximum(counted, 1.0) if mean else total), counted, aux.router_stats


def training_model(graphdef, params, model_state, balance_tokens: bool, solve: bool = True):
    """The model as the train step runs it: with solve (the controller on), every router solves its balancing
    correction, which the bias controller folds into the biases; with balance_tokens, it also selects with it, giving
    its experts equal shares of the forward's tokens (model/router.py)."""
    model = nnx.merge(graphdef, params, model_state)
    model.set_attributes(solve_balance=solve or balance_tokens, balance_tokens=balance_tokens)
    return model


def make_loss_fn(graphdef, reset_at_documents: bool, *, ce_chunk_tokens: int | None = None,
                 balance_tokens: bool = True, solve: bool = True):
    def loss_fn(params, model_state, batch):
        model = training_model(graphdef, params, model_state, balance_tokens, solve)
        mean, _, counts = loss_sums(model, batch, reset_at_documents, ce_chunk_tokens, mean=True)
        return mean, counts
    return loss_fn


def make_local_loss_sums(graphdef, reset_at_documents: bool, cp: ContextParallel | None = None,
                         ce_chunk_tokens: int | None = None, balance_tokens: bool = True, solve: bool = True):
    """make_loss_fn's loss as per-device sums, for data/context parallelism in shard_map
    (zaya_jax/parallel/data_parallel.py): (sum of token losses, counted tokens, expert counts) of this device's
    rows; with cp, of its zigzag share of their tokens (zaya_jax/parallel/context.py; full logits there)."""

    def local_sums(params, model_state, batch):
        model = training_model(graphdef, params, model_state, balance_tokens, solve)
        if cp is None:
            return loss_sums(model, batch, reset_at_documents, ce_chunk_tokens)
        extra = model_inputs(batch, reset_at_documents)
        logits, aux = cp.local_forward(model, batch["inputs"], extra.get("positions"), extra.get("segment_ids"))
        batch = {k: cp.rows(v) for k, v in batch.items()}
        terms, counted = token_cross_entropy_terms(logits, batch["targets"], loss_mask(batch, reset_at_documents))
        return terms.sum(), counted.sum(), aux.router_stats

    return local_sums


def _accumulate(total, *grads):
    """total + grads[0] + grads[1] + ... in fp32, in that order: one pass over the sum for all of them."""
    for g in grads:
        total = total + g.astype(jnp.float32)
    return total


def _group_size(k: int, wanted: int) -> int:
    """The largest divisor of k that is at most `wanted` (microbatches per accumulation pass)."""
    return max(m for m in range(1, max(1, min(wanted, k)) + 1) if k % m == 0)


def make_accumulating_train_step(graphdef, tx: optax.GradientTransformation, balancer: BalancerConfig, *,
                                 reset_at_documents: bool = False, ce_chunk_tokens: int | None = None, grad_fn=None,
                                 compute_dtype=None, per_layer_view: bool = False, grads_per_pass: int = 1,
                                 defer_expert_wgrad: bool = False, balance_tokens: bool | None = None):
    """train_step(state, batches) -> (state, metrics): one optimizer step over the k microbatches of `batches`
    (every field [k, rows, ...]; k is static, so each k compiles its own program). grad_fn(params, model_state,
    batch) -> ((loss, expert counts), grads) replaces value_and_grad of the model loss (data/context parallelism in
    shard_map plugs in here: zaya_jax/parallel/data_parallel.py). compute_dtype: with k > 1, the weights the model
    reads only in this dtype are cast once before the microbatch loop instead of once per microbatch
    (model/compute_view.py; their micro-gradients then come in that dtype and are summed in fp32, the same values).
    per_layer_view (unrolled layers only, scan_layers=False): with k > 1, the stacked layer parameters are also sliced
    per layer once before the loop, and (with the default grad_fn; a given one returns stacked gradients) the fp32
    sum is kept per layer and stacked once after it: no per-microbatch slicing of the weights nor restacking of their
    gradients (the same values).
    grads_per_pass: each loop iteration runs this many microbatches (the largest divisor of k up to it) and adds
    their gradients into the fp32 sum in one pass, in microbatch order (the same sums): one read and write of the
    sum per group instead of per microbatch, for holding that many gradients minus one in the compute dtype.
    defer_expert_wgrad (with per_layer_view, the default grad_fn and moe_impl 'pallas'): the expert weights' gradients
    of a group's microbatches are formed after it, added to the fp32 sum by one kernel per weight
    (model/deferred_wgrad.py: the same sum without their per-microbatch rounding to the compute dtype).
    balance_tokens (with the default grad_fn; default: the controller is on): routers select with the
    per-microbatch balancing correction (model/router.py).
    With k > 1 and the default grad_fn, the embedding lookup's gradient comes out as rows, scattered into the fp32
    sum after the pass, so the table's gradient is the head GEMM alone, added to the sum in place
    (model/embedding_tap.py: the same terms in another order).

    Metrics: loss and the per-layer routing figures (`routing/NAME`, [L]: optim/balancing.py RoutingHealth) are means
    over the microbatches (each microbatch's loss is its token mean); grad_norm is the norm of the mean gradient the
    optimizer gets."""
    if grads_per_pass < 1:
        raise ValueError(f"grads_per_pass={grads_per_pass} must be >= 1")
    custom_grad_fn = grad_fn is not None
    if defer_expert_wgrad and (custom_grad_fn or not per_layer_view or compute_dtype is None):
        raise ValueError("defer_expert_wgrad needs the per-layer view in the compute dtype (per_layer_view and "
                         "compute_dtype, unrolled layers) and the default gradient function (not a data/context "
                         "parallel grad_fn)")
    # the routers balance each microbatch whenever the controller is on (model/router.py); False: the biases alone
    balancing_in_microbatch = balancer.learning_rate > 0 if balance_tokens is None else balance_tokens
    grad_fn = grad_fn or jax.value_and_grad(make_loss_fn(graphdef, reset_at_documents, ce_chunk_tokens=ce_chunk_tokens,
                                                         balance_tokens=balancing_in_microbatch,
                                                         solve=balancer.learning_rate > 0), has_aux=True)

    def microbatch(params, model_state, balancer_state, batch):
        """Gradient of one microbatch, then the bias controller on its routing statistics."""
        (loss, stats), grads = grad_fn(params, model_state, batch)
        biases, balancer_state, health = update_biases(get_biases(model_state), balancer_state, stats, balancer)
        metrics = {"loss": loss, **{f"routing/{name}": v for name, v in health._asdict().items()}}
        return grads, with_biases(model_state, biases), balancer_state, metrics

    def train_step(state: dict[str, Any], batches: dict[str, jax.Array]):
        params = state["params"]
        k = jax.tree.leaves(batches)[0].shape[0]
        if k < 1:
            raise ValueError(f"an optimizer step needs at least one microbatch; the batches' leading axis is {k}")
        if k == 1:  # no loop, no accumulator: the same program as a plain one-microbatch step
            grads, model_state, balancer_state, metrics = microbatch(
                params, state["model_state"], state["balancer"], jax.tree.map(lambda x: x[0], batches))
        else:
            view = compute_view(params, compute_dtype, per_layer=per_layer_view)  # the same leaves when neither
            grad_view = view
            if defer_expert_wgrad:
                tokens = batches["inputs"].shape[1] * batches["inputs"].shape[2]
                grad_view = deferred_wgrad.defer_expert_wgrads(view, tokens, gmm.block_rows(compute_dtype))
            tap_rows = not custom_grad_fn
            if tap_rows:
                grad_view = embedding_tap.tap(grad_view, batches["inputs"].shape[1:3], compute_dtype)

            m = _group_size(k, grads_per_pass)

            def body(carry, group):
                total, model_state, balancer_state = carry
                group_grads, group_metrics = [], []
                for j in range(m):
                    grads, model_state, balancer_state, metrics = microbatch(
                        grad_view, model_state, balancer_state, jax.tree.map(lambda x: x[j], group))
                    group_grads.append(grads)
                    group_metrics.append(metrics)
                if tap_rows:
                    group_grads, rows = zip(*map(embedding_tap.split, group_grads))
                if defer_expert_wgrad:
                    total = deferred_wgrad.accumulate(total, group_grads, _accumulate, impl="pallas")
                else:
                    total = jax.tree.map(_accumulate, total, *group_grads)
                if tap_rows:
                    total = embedding_tap.add_rows(total, rows, [group["inputs"][j] for j in range(m)])
                return (total, model_state, balancer_state), jax.tree.map(lambda *v: jnp.stack(v), *group_metrics)

            # the gradients' structure: per layer from value_and_grad at a per-layer view, stacked from a grad_fn
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params if custom_grad_fn else view)
            groups = jax.tree.map(lambda x: x.reshape((k // m, m) + x.shape[1:]), batches)
            (total, model_state, balancer_state), per_micro = jax.lax.scan(
                body, (zeros, state["model_state"], state["balancer"]), groups)
            grads = jax.tree.map(lambda t, p: (t / k).astype(p.dtype), stack_layer_slices(total), params)
            # [k // m, m, ...] -> the mean over the k microbatches; per-layer figures stay [L]
            metrics = jax.tree.map(lambda v: v.reshape((k,) + v.shape[2:]).mean(0), per_micro)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state, "model_state": model_state, "balancer": balancer_state}
        return new_state, {**metrics, "grad_norm": optax.tree.norm(grads)}

    return train_step


def make_train_step(graphdef, tx: optax.GradientTransformation, balancer: BalancerConfig, **kwargs):
    """train_step(state, batch) -> (state, metrics): one optimizer step on ONE microbatch (fields [rows, ...]);
    make_accumulating_train_step with k = 1, same arguments."""
    accumulating_step = make_accumulating_train_step(graphdef, tx, balancer, **kwargs)

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array]):
        return accumulating_step(state, jax.tree.map(lambda x: x[None], batch))

    return train_step


def make_eval_step(graphdef, num_sources: int, *, reset_at_documents: bool = False):
    """Summed loss and token count per source (rows with source_id -1 are padding), and the routing statistics
    of the real rows [L, 4 E + 7] (model/routing_stats.py): evaluation routes as inference does, with the stored
    balancing biases alone."""

    def eval_step(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state)
        real = jnp.broadcast_to(batch["source_ids"][:, None] >= 0, batch["inputs"].shape)
        logits, aux = model.forward(batch["inputs"], real, **model_inputs(batch, reset_at_documents))
        terms, counted = token_cross_entropy_terms(logits, batch["targets"], loss_mask(batch, reset_at_documents))
        onehot = jax.nn.one_hot(batch["source_ids"], num_sources, dtype=jnp.float32)  # -1 -> zero row
        return onehot.T @ terms.sum(-1), onehot.T @ counted.sum(-1), aux.router_stats

    return eval_step

"""Our side of the HF parity tests: logits, next-token loss and gradients keyed like the HF checkpoint, models
with random non-default values in every leaf, and the error metrics the tests use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.checkpoint.hf import hf_named_arrays
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.model.loss import next_token_cross_entropy


def logits_of(model, input_ids, attention_mask=None) -> np.ndarray:
    """model(input_ids, attention_mask) under jit (eager dispatch would compile every op separately)."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = None if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    return np.asarray(fwd(state, ids, mask))


def run_case(model, case: dict):
    """-> (logits [B,T,V] np, loss float, expert counts [L, E+1] np (padding excluded), {HF key: gradient})."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids, mask, labels):
        logits, aux = nnx.merge(graphdef, params, rest).forward(ids, mask)
        return next_token_cross_entropy(logits, labels), (logits, aux.expert_counts)

    ids = jnp.asarray(case["input_ids"], jnp.int32)
    mask = None if case["attention_mask"] is None else jnp.asarray(case["attention_mask"], jnp.int32)
    labels = jnp.asarray(case["labels"], jnp.int32)
    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, (logits, counts)), grads = step(params, ids, mask, labels)
    return np.asarray(logits), float(loss), np.asarray(counts), hf_named_arrays(grads)


def random_model(cfg, seed: int, skip_bias: float = -0.7):
    """A ZayaForCausalLM whose every leaf holds a random non-default value, built without running the model's
    initialisers (an abstract model filled from numpy, so no per-op compiles): matrices N(0, 1/fan_in), scales
    and norm weights U(0.6, 1.4), biases N(0, 0.2^2), temp U(0.5, 1.5), expert balancing biases U(-0.05, 0.05)
    and `skip_bias` for the skip class."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    filled = []
    for path, var in nnx.to_flat_state(state):
        path = tuple(map(str, path))
        shape, dtype = var.shape, var.get_value().dtype
        stacked = path[:2] == ("model", "layers") or path == ("model", "router_states_scale")
        own = shape[1:] if stacked else shape  # shape of one layer's tensor
        if isinstance(var, BalancingBias):
            value = rng.uniform(-0.05, 0.05, shape)
            value[..., -1] = skip_bias
        elif path[-1] == "temp":
            value = rng.uniform(0.5, 1.5, shape)
        elif len(own) >= 2:
            fan_in = own[-1] if "experts" in path else int(np.prod(own[1:]))
            value = rng.normal(0.0, fan_in ** -0.5, shape)
        elif path[-1].endswith("bias"):
            value = rng.normal(0.0, 0.2, shape)
        else:
            value = rng.uniform(0.6, 1.4, shape)
        filled.append((path, var.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def max_rel(ours, ref) -> float:
    """max |ours - ref| / max |ref|: the worst element error on the scale of the largest reference value."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def norm_rel(ours, ref) -> float:
    """||ours - ref|| / ||ref|| (Frobenius); 0 when both are exactly zero."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    diff = float(np.linalg.norm(ours - ref))
    return diff / float(np.linalg.norm(ref)) if diff else 0.0

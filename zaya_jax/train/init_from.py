"""train.init_from: a new run's parameters and balancing biases from a previous run (Orbax, any device count: its
latest step, or the step whose folder is named) or from a Hugging Face ZAYA directory (config.json + safetensors:
fine-tuning a released model). The optimizer state and the data position start fresh."""

from __future__ import annotations

import os

import jax
from flax import nnx

from zaya_jax.checkpoint.manager import abstract_like, restore_subset
from zaya_jax.config import ModelConfig

# config.json fields that may differ from the run's model: token ids, the positions table, the init scale and RoPE
# (a context extension changes theta); every other field decides the weights' shapes or the math
_MAY_DIFFER = ("pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings", "initializer_range",
               "rope_parameters", "use_cache")


def initialize_from(src: str, state: dict, cfg: ModelConfig, *, log=print) -> dict:
    """`state` with params and model_state replaced by those of `src`, laid out with `state`'s shardings."""
    from zaya_jax.inference.loading import is_hf_directory, orbax_directory, step_folder
    from zaya_jax.train.errors import TrainConfigError

    if not os.path.isdir(src):
        raise TrainConfigError(f"train.init_from={src}: no such directory (a run, one of its checkpoint steps, or a "
                               "Hugging Face directory)")
    if is_hf_directory(src):
        loaded = _from_hf(src, state, cfg, log)
        return {**state, **loaded}
    src, step = step_folder(src) or (orbax_directory(src), None)  # one step's folder: that step; else the latest
    subset = {k: state[k] for k in ("params", "model_state")}
    step0, loaded = restore_subset(src, abstract_like(subset), step=step)
    log(f"initialised parameters and balancing biases from {src} step {step0} (fresh optimizer and data)")
    return {**state, **loaded}


def _from_hf(src: str, state: dict, cfg: ModelConfig, log) -> dict:
    from zaya_jax.checkpoint.hf import from_hf, read_hf_config
    from zaya_jax.model.base import BalancingBias
    from zaya_jax.train.errors import TrainConfigError

    ours = cfg.to_hf_dict()
    how = {k: v for k, v in vars(cfg).items() if k not in ours and k != "rope"}  # dtype, impls, scan_layers
    theirs = read_hf_config(src, **how).to_hf_dict()
    diffs = [k for k in sorted(set(ours) | set(theirs)) if k not in _MAY_DIFFER and ours.get(k) != theirs.get(k)]
    if diffs:
        raise TrainConfigError(f"train.init_from={src}: its config.json does not match this run's model: " +
                               ", ".join(f"{k} {theirs.get(k)!r} (run: {ours.get(k)!r})" for k in diffs))
    model = from_hf(src, dtype=cfg.dtype, param_dtype=cfg.param_dtype, **{k: v for k, v in how.items()
                                                                          if k not in ("dtype", "param_dtype")})
    _, params, model_state = nnx.split(model, nnx.Param, BalancingBias)
    loaded = {"params": nnx.to_pure_dict(params), "model_state": nnx.to_pure_dict(model_state)}
    target = {k: state[k] for k in loaded}
    loaded = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding).astype(like.dtype), loaded, target)
    log(f"initialised parameters and balancing biases from the Hugging Face directory {src} (fresh optimizer and "
        f"data)")
    return loaded

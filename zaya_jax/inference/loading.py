"""A model for inference from either checkpoint format:

- a Hugging Face directory (config.json + safetensors), read by zaya_jax.from_hf;
- an Orbax training checkpoint (a run's workdir or its checkpoints/ folder): the model config comes from the
  checkpoint's meta item, params and balancing biases from its state (the optimizer state is not read).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from zaya_jax.checkpoint.hf import CONFIG_FILE, from_hf
from zaya_jax.checkpoint.manager import CheckpointError, first_readable, restore_subset
from zaya_jax.config import PARAM_DTYPES, ModelConfig
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias


def is_hf_directory(path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def load_model(path, *, dtype: str = "float32", step: int | None = None, **overrides) -> ZayaForCausalLM:
    """`dtype` is the compute dtype, and the parameters are stored in it too when it is a parameter dtype (float32,
    bfloat16; float16 computes from fp32 parameters): inference keeps no fp32 master copy to read and cast on every
    call. `overrides` set other non-HF ModelConfig fields (moe_impl, attention_impl, param_dtype). The balancing
    biases stay fp32."""
    name = jnp.dtype(dtype).name
    overrides.setdefault("param_dtype", name if name in PARAM_DTYPES else "float32")
    if is_hf_directory(path):
        if step is not None:
            raise ValueError(f"{path} is a Hugging Face directory: it has no steps to choose from")
        return from_hf(path, dtype=jnp.dtype(dtype), **overrides)
    return load_orbax(path, dtype=dtype, step=step, **overrides)


def matmul_precision(dtype: str):
    """The GEMM precision for inference in `dtype`, as a context: fp32 GEMMs for float32, as HF's fp32 (JAX's default
    lets a GPU round fp32 GEMM inputs to TF32); JAX's default otherwise."""
    return jax.default_matmul_precision("highest" if jnp.dtype(dtype) == jnp.float32 else None)


def step_folder(path) -> tuple[str, int] | None:
    """(the checkpoints/ folder, the step) when `path` is the folder of one step of a run, else None."""
    parent, name = os.path.split(os.path.abspath(path))
    if name.isdigit() and os.path.basename(parent) == "checkpoints":
        return parent, int(name)
    return None


def orbax_directory(path) -> str:
    """The folder holding the numbered checkpoints: `path` itself or its checkpoints/ child (a run's workdir)."""
    child = os.path.join(path, "checkpoints")
    directory = child if os.path.isdir(child) else path
    one_step = step_folder(path)
    if one_step is not None:
        raise CheckpointError(f"{path} is the folder of one step: pass its run, --checkpoint "
                              f"{os.path.dirname(one_step[0])} --step {one_step[1]}")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{path}: neither a Hugging Face directory (no {CONFIG_FILE}) nor an Orbax "
                              f"checkpoint folder")
    return os.path.abspath(directory)


def read_meta(directory: str, step: int | None = None) -> tuple[int, dict]:
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no finished checkpoint in {directory}")
    if step not in mngr.all_steps():
        raise CheckpointError(f"no checkpoint for step {step} in {directory} (have {sorted(mngr.all_steps())})")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if "model" not in meta:
        raise CheckpointError(f"{directory} step {step}: its meta has no model config")
    return step, meta


def load_orbax(path, *, dtype: str = "float32", step: int | None = None, log=None,
               **overrides) -> ZayaForCausalLM:
    """Without `step`, a latest checkpoint that cannot be read falls back to the one before it, as training and
    evaluation do (it is not moved: readers leave the run directory as it is). `log`: default stderr."""
    directory = orbax_directory(path)
    steps = sorted(ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)).all_steps())
    if not steps and step is None:
        raise CheckpointError(f"no finished checkpoint in {directory}")
    candidates = [step] if step is not None else steps[::-1]  # a step asked for by number has no stand-in
    return first_readable(directory, candidates, lambda s: _load_orbax_step(directory, s, dtype, overrides),
                          log=log or (lambda m: print(m, file=sys.stderr)))


def _load_orbax_step(directory: str, step: int, dtype: str, overrides: dict) -> ZayaForCausalLM:
    step, meta = read_meta(directory, step)
    cfg = ModelConfig.from_hf_dict(meta["model"], dtype=jnp.dtype(dtype).name, **overrides)
    abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, model_state = nnx.split(abstract, nnx.Param, BalancingBias)
    device = SingleDeviceSharding(jax.devices()[0])
    wanted = {"params": nnx.to_pure_dict(params), "model_state": nnx.to_pure_dict(model_state)}
    wanted = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), wanted)
    _, restored = restore_subset(directory, wanted, step=step)
    return nnx.merge(graphdef, restored["params"], restored["model_state"])

"""Hugging Face ZAYA checkpoints (config.json + safetensors) in and out of our Flax NNX model.

`from_hf(path)` builds the model abstractly (no allocation), checks every key and shape against the config before
reading data, then reads tensors one at a time. Large stacked leaves are filled layer by layer into a device array
updated in place (donated buffer), so an 8B checkpoint needs host memory for one layer's tensor, not a second copy
of the model; small leaves are stacked on the host.
`to_hf(model, path)` writes a directory that `transformers.ZayaForCausalLM.from_pretrained` loads.

Balancing biases are read exactly as the file holds them. (transformers 5.23 re-initialises the skip-class bias
to -1 when it loads a checkpoint; we do not, see zaya1_spec.md section 5.1.)
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.checkpoint.errors import ZayaCheckpointError
from zaya_jax.checkpoint.hf_keys import HFTensor, hf_tensors
from zaya_jax.checkpoint.run_layout import RUN_RECORD, run_above
from zaya_jax.checkpoint.safetensors_io import SafetensorsReader, existing_weight_files, write_sharded
from zaya_jax.config import ConfigError, ModelConfig
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias

CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_HOST_STACK_BYTES = 1 << 28  # stacked leaves up to this size are assembled on the host (no per-shape compile)
_TIED_HEAD_KEY = "lm_head.weight"


def read_hf_config(path, **overrides) -> ModelConfig:
    """ModelConfig from a HF directory's config.json; `overrides` set our non-HF fields (dtype, moe_impl, ...)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ZayaCheckpointError(f"checkpoint directory {directory} does not exist")
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise ZayaCheckpointError(f"{directory} has no {CONFIG_FILE}")
    try:
        d = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ZayaCheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(d, dict) or d.get("model_type") != "zaya":
        got = d.get("model_type") if isinstance(d, dict) else type(d).__name__
        raise ZayaCheckpointError(f"{file}: model_type is {got!r}, not 'zaya'; this is not a ZAYA checkpoint")
    try:
        return ModelConfig.from_hf_dict(d, **overrides)
    except (ConfigError, TypeError) as e:
        raise ZayaCheckpointError(f"{file}: {e}") from e


def stored_dtype(path) -> str | None:
    """The tensor dtype config.json declares ('dtype', or the older 'torch_dtype'), e.g. 'bfloat16'."""
    d = json.loads((Path(path) / CONFIG_FILE).read_text())
    return d.get("dtype") or d.get("torch_dtype")


def from_hf(path, dtype=jnp.float32, *, param_dtype=jnp.float32, **config_overrides) -> ZayaForCausalLM:
    """Loads a HF ZAYA directory. `dtype` is the compute dtype, `param_dtype` the stored parameter dtype (fp32
    master weights by default; the file's dtype is cast). Other keyword arguments override ModelConfig fields
    that are not in config.json (moe_impl, attention_impl, remat, ...)."""
    directory = Path(path)
    cfg = read_hf_config(directory, dtype=jnp.dtype(dtype).name, param_dtype=jnp.dtype(param_dtype).name,
                         **config_overrides)
    abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(abstract_state))
    tensors = hf_tensors(flat)
    with SafetensorsReader(directory) as reader:
        _check_checkpoint(reader, tensors, cfg, directory)
        values = _read_leaves(reader, flat, tensors)
    state = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in flat])
    return nnx.merge(graphdef, state)


def _ignorable(key: str, cfg: ModelConfig) -> bool:
    if key == _TIED_HEAD_KEY and cfg.tie_word_embeddings:
        return True  # some writers store the tied head anyway; HF (and we) use the embedding
    return key.endswith("rotary_emb.inv_freq")  # derived from the config, stored by old writers


def _check_checkpoint(reader: SafetensorsReader, tensors: list[HFTensor], cfg: ModelConfig, directory: Path):
    expected = {t.key for t in tensors}
    found = reader.keys()
    missing = sorted(expected - found)
    if missing:
        raise ZayaCheckpointError(f"{directory}: {len(missing)} tensor(s) required by config.json are missing from "
                                  f"the checkpoint: {_some(missing)}")
    unexpected = sorted(k for k in found - expected if not _ignorable(k, cfg))
    if unexpected:
        raise ZayaCheckpointError(f"{directory}: {len(unexpected)} unexpected tensor(s) that a ZAYA model with this "
                                  f"config.json does not have: {_some(unexpected)}")
    for t in tensors:
        got = reader.shape(t.key)
        if got != t.shape:
            raise ZayaCheckpointError(f"{directory}: tensor {t.key} has shape {list(got)} but config.json implies "
                                      f"{list(t.shape)}")
        if not reader.is_float(t.key):
            raise ZayaCheckpointError(f"{directory}: tensor {t.key} has dtype {reader.dtype(t.key)}, expected a "
                                      f"floating-point type")


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" ... (+{len(keys) - n} more)" if len(keys) > n else "")


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(stack, row, index):
    return jax.lax.dynamic_update_index_in_dim(stack, row.astype(stack.dtype), index, 0)


def _read_leaves(reader: SafetensorsReader, flat, tensors: list[HFTensor]) -> dict[tuple, jax.Array]:
    by_path: dict[tuple, list[HFTensor]] = defaultdict(list)
    for t in tensors:
        by_path[t.path].append(t)
    values = {}
    for path, var in flat:
        path = tuple(str(p) for p in path)
        spec = var.get_value()
        dtype = np.dtype(spec.dtype)
        parts = by_path[path]
        if len(parts) == 1 and parts[0].index is None:
            values[path] = jnp.asarray(np.asarray(reader.read(parts[0].key), dtype=dtype))
        elif math.prod(spec.shape) * dtype.itemsize <= _HOST_STACK_BYTES:
            host = np.empty(spec.shape, dtype)
            for t in parts:
                host[t.index] = reader.read(t.key)
            values[path] = jnp.asarray(host)
        else:  # one layer on the host at a time; the stacked device buffer is updated in place
            stack = jnp.zeros(spec.shape, dtype)
            for t in parts:
                stack = _set_row(stack, reader.read(t.key), t.index)
            values[path] = stack
    return values


@jax.jit
def _get_row(stack, index):
    return jax.lax.dynamic_index_in_dim(stack, index, 0, keepdims=False)


def _to_host(value, t: HFTensor) -> np.ndarray:
    """HF tensor `t` of our leaf `value` on the host: a zero-copy view on the CPU backend, otherwise a transfer
    of that one layer's slice."""
    if isinstance(value, np.ndarray) or all(d.platform == "cpu" for d in value.devices()):
        full = np.asarray(value)
        return full if t.index is None else full[t.index]
    return np.asarray(value if t.index is None else _get_row(value, t.index))


def hf_named_arrays(state) -> dict[str, np.ndarray]:
    """HF key -> numpy array for a small state (e.g. gradients of a test model); to_hf streams instead."""
    leaves = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    return {t.key: _to_host(leaves[t.path].get_value(), t) for t in hf_tensors(leaves.items())}


class ExistingWeightsError(ZayaCheckpointError):
    """The export directory already holds weights and the caller did not ask to replace them. `hint(how)` is the
    message with the caller's way of asking (a command line names its flag)."""

    def __init__(self, directory: Path, files: list[Path]):
        self.directory, self.files = directory, files
        super().__init__(self.hint("overwrite=True"))

    def hint(self, how: str) -> str:
        return (f"{self.directory} already holds weights ({', '.join(f.name for f in self.files)}); "
                f"pass {how} to replace them")


def _is_training_run(directory: Path) -> bool:
    """A run's workdir (run.json, checkpoints/) or the checkpoints/ folder of one."""
    return ((directory / RUN_RECORD).exists() or (directory / "checkpoints").is_dir()
            or (directory.name == "checkpoints" and (directory.parent / RUN_RECORD).exists()))


def check_export_target(path, *, source=None, overwrite: bool = False) -> Path:
    """Refuses an export directory that would lose or corrupt data: a training run or a folder inside one (its
    config.json would make the run, or one of its checkpoints, read as a HF directory; a folder in checkpoints/
    reads as an unreadable step), the directory `source` the model is read from, a file, or one holding weights
    without `overwrite`. Callers run it before loading the model, to fail at once; to_hf runs it again."""
    directory = Path(path)
    if _is_training_run(directory):
        raise ZayaCheckpointError(f"{directory} holds a training run (run.json, checkpoints/): export to another "
                                  "directory")
    run = run_above(directory)
    if run is not None:
        raise ZayaCheckpointError(f"{directory} is inside the training run {run}: export to a directory outside it")
    if source is not None and directory.exists() and Path(source).exists() and os.path.samefile(directory, source):
        raise ZayaCheckpointError(f"{directory} is the checkpoint being exported: export to another directory")
    if directory.exists() and not directory.is_dir():
        raise ZayaCheckpointError(f"{directory} is a file, not a directory: export to a directory")
    old = existing_weight_files(directory) if directory.is_dir() else []
    if old and not overwrite:
        raise ExistingWeightsError(directory, old)
    return directory


def to_hf(model: ZayaForCausalLM, path, *, dtype=None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
          overwrite: bool = False) -> Path:
    """Writes `model` as a HF directory (config.json + safetensors, sharded with an index above `max_shard_bytes`).
    `dtype` casts the parameters (default: as stored); balancing biases stay fp32 like the HF buffer. A tied
    lm_head is not written. Refuses to mix with existing weight files unless `overwrite`, and refuses a training
    run's directory (check_export_target). Replaced weights are removed only once the new ones are written."""
    directory = check_export_target(path, overwrite=overwrite)
    directory.mkdir(parents=True, exist_ok=True)
    old = existing_weight_files(directory)

    leaves = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model))}
    tensors = hf_tensors(leaves.items())
    by_key = {t.key: t for t in tensors}

    def out_dtype(t: HFTensor) -> np.dtype:
        var = leaves[t.path]
        if isinstance(var, BalancingBias) or dtype is None:
            return np.dtype(var.get_value().dtype)
        return np.dtype(jnp.dtype(dtype))

    def produce(key: str) -> np.ndarray:
        t = by_key[key]
        return _to_host(leaves[t.path].get_value(), t).astype(out_dtype(t), copy=False)

    entries = [(t.key, t.shape, out_dtype(t)) for t in tensors]
    written = write_sharded(directory, entries, produce, max_shard_bytes)
    for f in set(old) - set(written):  # the old layout's other shards / index, which would shadow the new file
        f.unlink(missing_ok=True)

    config = model.cfg.to_hf_dict()
    config["dtype"] = jnp.dtype(dtype).name if dtype is not None else model.cfg.param_dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory

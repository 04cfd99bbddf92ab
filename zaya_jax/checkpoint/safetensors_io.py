"""Safetensors files of a Hugging Face model directory: lazy reading and sharded writing.

Reading opens every file once and hands out one tensor at a time (numpy, bf16 through ml_dtypes), so a caller
that consumes tensors one by one never holds more than one of them on the host. Writing follows the Hugging Face
layout: `model.safetensors`, or `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json` when the
tensors exceed the shard size.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from zaya_jax.checkpoint.errors import ZayaCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class SafetensorsReader(contextlib.AbstractContextManager):
    """key -> (shape, dtype) without reading data, and key -> numpy array on demand."""

    def __init__(self, directory: Path):
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}  # key -> open safe_open handle
        for file in _weight_files(directory):
            handle = self._stack.enter_context(safe_open(str(file), framework="numpy"))
            for key in handle.keys():
                self._handles[key] = handle

    def __exit__(self, *exc):
        self._stack.close()
        return False

    def keys(self) -> set[str]:
        return set(self._handles)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[key].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self._handles[key].get_slice(key).get_dtype()

    def is_float(self, key: str) -> bool:
        return self.dtype(key) in _FLOAT_DTYPES

    def read(self, key: str) -> np.ndarray:
        return self._handles[key].get_tensor(key)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ZayaCheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from e
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ZayaCheckpointError(f"{index} lists weight files that do not exist: {missing}")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ZayaCheckpointError(f"no weights in {directory}: expected {SINGLE_FILE} or {INDEX_FILE}")


def existing_weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("model*.safetensors")) + sorted(directory.glob(INDEX_FILE))


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (os.umask can only read it by setting
    it, for a moment, under every other thread's feet)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def file_mode() -> int:
    """The mode a plain new file gets (open() / write_text): 0o666 less the umask, usually 0644."""
    return 0o666 & ~_umask()


def _temporary(directory: Path, name: str) -> Path:
    """A fresh hidden file beside `name` that no weight-file glob (model*.safetensors) matches."""
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    return Path(temp)


def write_sharded(directory: Path, entries: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                  produce: Callable[[str], np.ndarray], max_shard_bytes: int) -> list[Path]:
    """Writes the tensors named by `entries` (key, shape, dtype), calling `produce(key)` for each one while its
    shard is written, so at most one shard is on the host at a time. Returns the files written."""
    sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for _, shape, dt in entries]
    shards: list[list[int]] = [[]]
    shard_bytes = 0
    for i, size in enumerate(sizes):  # greedy; a tensor larger than the limit gets a shard of its own
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(i)
        shard_bytes += size
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    mode = file_mode()
    written: list[tuple[Path, Path]] = []  # (temporary file, its final name)
    try:
        # every shard is written under a temporary name first: a failure (a full disk) leaves the weights that
        # were there before in place, and no file is ever seen half-written or with safetensors' mode 0600
        for name, members in zip(names, shards):
            tensors = {}
            for i in members:
                key, shape, dt = entries[i]
                array = np.ascontiguousarray(produce(key))
                if array.shape != tuple(shape) or array.dtype != np.dtype(dt):
                    raise ZayaCheckpointError(f"{key}: produced {array.dtype}{list(array.shape)}, "
                                              f"expected {np.dtype(dt)}{list(shape)}")
                tensors[key] = array
                weight_map[key] = name
            temp = _temporary(directory, name)
            written.append((temp, directory / name))
            save_file(tensors, str(temp), metadata={"format": "pt"})  # transformers requires 'format'
            del tensors
            os.chmod(temp, mode)  # safetensors creates 0600; the user's other files follow the umask
        if n > 1:
            index = {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}
            temp = _temporary(directory, INDEX_FILE)
            written.append((temp, directory / INDEX_FILE))
            temp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            os.chmod(temp, mode)
    except BaseException:
        for temp, _ in written:
            temp.unlink(missing_ok=True)
        raise
    for temp, final in written:  # the index last: it names shards that are all in place
        os.replace(temp, final)
    return [final for _, final in written]

"""Orbax checkpoints of the whole training state: asynchronous saves, restore onto any mesh.

One checkpoint = three Orbax items: `state` (params, optimizer state, balancing biases and controller state,
step: arrays, saved as logical (unsharded) arrays so a restore can lay them out on a different mesh), `data`
(the data iterator's JSON position) and `meta` (the model config and run info, checked on restore so a
checkpoint of another model is refused with a clear message instead of a shape error deep inside Orbax).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


# When one array of a corrupt checkpoint cannot be read, Orbax's restore fails with it (reported, and a fallback
# logged, in one line), and its sibling reads fail after that: asyncio reports each never-awaited one with its whole
# TensorStore spec. Those reports are dropped; nothing else asyncio logs is.
class _UnreadArrayTasks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("never retrieved" in message and ("async_deserialize" in message
                                                        or "Encountered error while reading array" in message))


logging.getLogger("asyncio").addFilter(_UnreadArrayTasks())


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, unfinished, or written for another model."""


class UnreadableCheckpointError(CheckpointError):
    """A step whose files cannot be read (an unfinished, truncated or damaged save): a reader of a run's latest step
    falls back to the step before it."""


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data: dict
    meta: dict


class CheckpointManager:
    def __init__(self, directory: str, *, save_interval_steps: int = 100, max_to_keep: int | None = 3,
                 async_save: bool = True):
        self.directory = os.path.abspath(directory)
        # cleanup_tmp_directories: a save killed mid-write leaves an unfinished tmp folder, never a usable step
        options = ocp.CheckpointManagerOptions(save_interval_steps=save_interval_steps, max_to_keep=max_to_keep,
                                               enable_async_checkpointing=async_save, create=True,
                                               cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    # ---- save ---------------------------------------------------------------------------------------------------
    def save(self, step: int, state, *, data: dict, meta: dict, force: bool = False) -> bool:
        """Starts an asynchronous save (returns once device buffers are copied); False if the interval skips it."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
                                  meta=ocp.args.JsonSave(_jsonable(meta)))
        return self._mngr.save(step, args=args, force=force)

    def reserve_transfer_memory(self, state) -> int:
        """On GPUs, grows XLA's pool of page-locked host memory to hold `state` once, so that every save's
        device->host copy (Orbax copies into pinned host memory there) reuses it instead of pinning fresh pages:
        pinning is what stalls a save, and it holds up the device's other work while it runs
        (benchmarks/d2h_probe.py). Returns the bytes reserved (0 where saves copy to pageable memory)."""
        if jax.default_backend() != "gpu":
            return 0
        shards = [shard.data for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
                  for shard in leaf.addressable_shards if shard.replica_id == 0]
        if not shards or not any(m.kind == "pinned_host" for m in shards[0].device.addressable_memories()):
            return 0
        copies = [jax.device_put(x, jax.sharding.SingleDeviceSharding(x.device, memory_kind="pinned_host"))
                  for x in shards]
        jax.block_until_ready(copies)
        return sum(x.nbytes for x in copies)  # the copies are freed on return; the pool keeps their pages

    def wait(self):
        self._mngr.wait_until_finished()

    def close(self):
        self._mngr.wait_until_finished()
        # Orbax's close() does not wait for the clean-up of unfinished tmp folders that its constructor started in a
        # thread (only a save does): a command that fails before its first save would leave it running into the
        # interpreter's exit, where it fails with a traceback ("cannot schedule new futures after shutdown")
        getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        self._mngr.close()

    # ---- restore ------------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def restore(self, abstract_state, *, step: int | None = None, expect_meta: dict | None = None,
                log=print, set_aside: bool = False) -> Restored:
        """Restores onto the shardings of `abstract_state` (a pytree of jax.ShapeDtypeStruct with .sharding), so
        the saving and the restoring mesh may differ. `expect_meta`: keys whose saved values must match.
        Without `step`, a latest checkpoint that cannot be read falls back to the one before it; `set_aside`
        (the trainer) also moves it into unreadable/, so it neither blocks nor counts toward later saves."""
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no finished checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} (have {steps})")
        candidates = [step] if step is not None else steps[::-1]
        return first_readable(self.directory, candidates, lambda s: self._restore_step(s, abstract_state, expect_meta),
                              log=log, set_aside=self._set_aside if set_aside else None)

    def _set_aside(self, step: int) -> str:
        """Moves an unreadable step to DIR/unreadable/STEP (kept for inspection, no longer a step of DIR)."""
        aside = os.path.join(self.directory, "unreadable")
        dest = os.path.join(aside, str(step))
        if jax.process_index() == 0:
            os.makedirs(aside, exist_ok=True)
            while os.path.exists(dest):  # set aside before: keep both
                dest += "+"
            os.rename(os.path.join(self.directory, str(step)), dest)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"zaya_set_aside_{step}")
        self._mngr.reload()
        return dest

    def _restore_step(self, step: int, abstract_state, expect_meta) -> Restored:
        meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        for key, want in (expect_meta or {}).items():
            got = meta.get(key)
            if _jsonable(want) != got:
                raise CheckpointError(f"checkpoint {self.directory} step {step} was written for a different "
                                      f"{key}: {_differences(got, _jsonable(want))} (checkpoint -> this run)")
        try:
            r = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                 data=ocp.args.JsonRestore()))
        except (ValueError, KeyError) as e:
            if "structure" in str(e).lower() or isinstance(e, KeyError):
                raise CheckpointError(f"checkpoint {self.directory} step {step} does not match this run's state "
                                      f"structure: {e}") from e
            raise
        return Restored(step=step, state=r["state"], data=r["data"], meta=meta)


def first_readable(directory: str, candidates: list[int], attempt, *, log, set_aside=None):
    """attempt(step) for each candidate step in turn until one reads. A step that cannot be read (files that fail
    to load: an unfinished, truncated or damaged save; or UnreadableCheckpointError) is logged and the next one
    tried, `set_aside(step)` first moving it away; any other CheckpointError (another model, another state) is
    raised at once, as is the last candidate's failure."""
    for i, s in enumerate(candidates):
        try:
            return attempt(s)
        except UnreadableCheckpointError as e:
            error = e
        except CheckpointError:
            raise
        except Exception as e:  # unreadable files: a corrupt or truncated checkpoint
            error = e
        if i + 1 == len(candidates):
            if isinstance(error, CheckpointError):
                raise error
            message = f"checkpoint {directory} step {s} cannot be read: {_reason(error)}"
            raise UnreadableCheckpointError(message) from error
        moved = f"; moved to {set_aside(s)}" if set_aside else ""
        log(f"checkpoint {directory} step {s} cannot be read ({type(error).__name__}: {_reason(error)}){moved}; "
            f"falling back to step {candidates[i + 1]}")


def restore_subset(directory: str, abstract_subset: dict, *, step: int | None = None) -> tuple[int, dict]:
    """Restores only the top-level entries of the saved `state` named in `abstract_subset` (e.g. params and
    model_state from the previous training phase, whose optimizer differs); shapes are checked by name."""
    mngr = ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(read_only=True))
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no finished checkpoint in {directory}")
    steps = mngr.all_steps()
    if step not in steps:
        raise CheckpointError(f"no finished checkpoint for step {step} in {directory} (have {sorted(steps)})")
    try:
        saved = ocp.PyTreeCheckpointer().metadata(os.path.join(mngr.directory, str(step), "state")).item_metadata
    except Exception as e:  # a step folder without readable metadata: an unfinished or damaged save
        raise UnreadableCheckpointError(f"{directory} step {step} cannot be read ({_reason(e)})") from e
    if saved is None:
        raise UnreadableCheckpointError(f"{directory} step {step} cannot be read (it holds no saved state)")
    for path, want in jax.tree_util.tree_flatten_with_path(abstract_subset)[0]:
        node = saved
        for k in path:
            key = getattr(k, "key", getattr(k, "idx", None))
            if key not in node:
                raise CheckpointError(f"{directory} step {step} has no {jax.tree_util.keystr(path)}")
            node = node[key]
        if tuple(node.shape) != tuple(want.shape):
            raise CheckpointError(f"{directory} step {step}: {jax.tree_util.keystr(path)} has shape "
                                  f"{tuple(node.shape)}, this model expects {tuple(want.shape)}")
    args = ocp.args.PyTreeRestore(item=abstract_subset, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_subset))
    return step, mngr.restore(step, args=ocp.args.Composite(state=args))["state"]


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs of `tree` carrying target shardings (default: the arrays' own)."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _reason(e: Exception) -> str:
    """The first 200 characters of an unreadable checkpoint's error, short of TensorStore's pointer to its details
    (a bound-method repr, not the details)."""
    return str(e).split(" See full TensorStore details")[0].strip()[:200]


def _jsonable(x):
    return json.loads(json.dumps(x, default=_default, sort_keys=True))


def _default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _differences(saved, wanted, prefix: str = "") -> str:
    """The keys whose values differ between two JSON values, as `key saved -> wanted` (whole values if not dicts)."""
    if not (isinstance(saved, dict) and isinstance(wanted, dict)):
        return f"{prefix or 'value'} {json.dumps(saved)} -> {json.dumps(wanted)}"
    parts = []
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key, "<unset>"), wanted.get(key, "<unset>")
        if a != b:
            parts.append(_differences(a, b, f"{prefix}{key}.") if isinstance(a, dict) and isinstance(b, dict)
                         else f"{prefix}{key} {json.dumps(a)} -> {json.dumps(b)}")
    return ", ".join(parts)

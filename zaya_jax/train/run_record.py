"""What a run directory is: DIR/run.json, written at the first start, holds the resolved config and the tokenizer
(its source path and sha256; a tokenizer.json is copied to DIR/tokenizer/). `launch.evaluate`, `launch.generate`,
`launch.evaluate_lm`, `launch.convert_hf --export` and a resume without `--config` read it, so nothing is repeated
on the command line and nothing falls back to the built-in corpus or the byte tokenizer. A resume whose config
differs in anything but the settings below is refused in one line naming the differences.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ml_collections import ConfigDict

from zaya_jax.checkpoint.run_layout import RUN_RECORD, run_above

TOKENIZER_DIR = "tokenizer"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# What a resume may change (a prefix ending in '.' covers a section): how long the run trains (the schedule
# follows train.steps), how it logs, evaluates and checkpoints, how it computes and on which devices; not what
# it computes (model, data, optimizer, seed).
RESUMABLE = ("train.steps", "optim.total_steps", "train.log_every", "train.eval_every", "train.eval_batches",
             "train.checkpoint_every", "train.keep_checkpoints", "train.fault", "train.peak_tflops",
             "train.init_from", "train.microbatch_tokens", "train.ce_chunk_tokens", "train.cast_weights_once",
             "train.grads_per_pass", "train.defer_expert_wgrad", "data.prefetch", "data.tokenizer", "mesh.",
             "parallel.", "model.overrides.attention_impl", "model.overrides.norm_impl", "model.overrides.ce_impl",
             "model.overrides.conv_impl", "model.overrides.moe_impl", "model.overrides.solve_impl",
             "model.overrides.remat")


def record_path(workdir: str) -> str:
    return os.path.join(workdir, RUN_RECORD)


def exists(workdir: str) -> bool:
    return os.path.isfile(record_path(workdir))


def read(workdir: str) -> dict:
    """The run record; a damaged one (cut short, edited) is named in one line."""
    from zaya_jax.train.errors import TrainConfigError

    path = record_path(workdir)
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read())
    except ValueError as e:  # JSON or UTF-8 errors
        raise TrainConfigError(f"{path} is damaged ({e}): restore it from a copy, or move it away and start the run "
                               "again with --config") from e
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict) or not isinstance(
            record.get("tokenizer"), dict):
        raise TrainConfigError(f"{path} is not a run record (no config and tokenizer): restore it from a copy, or "
                               "move it away and start the run again with --config")
    return record


def run_directory(path: str) -> str:
    """The run directory of `path`: itself, or the parent of its checkpoints/ folder."""
    path = os.path.abspath(path)
    if not exists(path) and os.path.basename(path.rstrip(os.sep)) == "checkpoints":
        return os.path.dirname(path)
    return path


def tokenizer_entry(spec: str) -> dict:
    """'byte' -> {'kind': 'byte'}; a tokenizer.json (or a folder holding one) -> its absolute path and sha256."""
    if spec == "byte":
        return {"kind": "byte"}
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"kind": "hf", "source": os.path.abspath(path), "sha256": digest,
            "file": os.path.join(TOKENIZER_DIR, "tokenizer.json")}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _jsonable(x):
    return json.loads(json.dumps(x, default=str, sort_keys=True))


def describe(config: ConfigDict) -> dict:
    return {"config": _jsonable(config.to_dict()), "tokenizer": tokenizer_entry(config.data.tokenizer)}


def differences(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, recorded, now) for every config key (and the tokenizer's content) that differs."""
    a, b = flatten(old["config"]), flatten(new["config"])
    out = [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    ta, tb = old.get("tokenizer", {}), new.get("tokenizer", {})
    if (ta.get("kind"), ta.get("sha256")) != (tb.get("kind"), tb.get("sha256")):
        out.append(("tokenizer", ta.get("sha256", ta.get("kind")), tb.get("sha256", tb.get("kind"))))
    return out


def _resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def _changes(diffs) -> str:
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in diffs)


def check_workdir(workdir: str) -> None:
    """Refuses a run directory that would mix the run with other data: a file, a folder inside another run (a run's
    folders belong to its trainer: a new step-like folder in its checkpoints/ reads as its latest step), or a Hugging
    Face directory (weights and config.json, no run record: a run starts from it with train.init_from)."""
    from zaya_jax.train.errors import TrainConfigError

    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise TrainConfigError(f"run directory {workdir} is a file, not a directory")
    run = run_above(path)
    if run is not None:
        raise TrainConfigError(f"run directory {workdir} is inside the training run {run}: use a directory outside it")
    from zaya_jax.checkpoint.safetensors_io import existing_weight_files

    weights = existing_weight_files(Path(path))
    if not exists(path) and weights and os.path.isfile(os.path.join(path, "config.json")):
        raise TrainConfigError(f"run directory {workdir} is a Hugging Face directory (config.json, {weights[0].name}): "
                               f"train in another directory, starting from it with --config.train.init_from={workdir}")


def ensure(config: ConfigDict, workdir: str, *, resuming: bool, write: bool = True, log=print) -> dict:
    """At a first start writes DIR/run.json (and copies the tokenizer); on a resume checks the config against it:
    a difference outside RESUMABLE raises TrainConfigError (one line), allowed ones are logged and recorded."""
    from zaya_jax.train.errors import TrainConfigError

    current = describe(config)
    if resuming and exists(workdir):
        diffs = differences(read(workdir), current)
        fixed = [d for d in diffs if not _resumable(d[0])]
        if fixed:
            raise TrainConfigError(f"{workdir} was trained with a different config ({RUN_RECORD}): {_changes(fixed)}; "
                                   f"use a new --workdir, or delete {record_path(workdir)} to accept the change")
        if diffs:
            log(f"resuming {workdir} with {_changes(diffs)}")
    if write:
        _save(current, workdir)
    return current


def _save(record: dict, workdir: str) -> None:
    os.makedirs(workdir, exist_ok=True)
    tok = record["tokenizer"]
    if tok["kind"] == "hf":  # a copy in the run directory: the run stays usable if the original moves
        target = os.path.join(workdir, TOKENIZER_DIR)
        os.makedirs(target, exist_ok=True)
        source_dir = os.path.dirname(tok["source"])
        for name in _TOKENIZER_FILES:
            src = tok["source"] if name == "tokenizer.json" else os.path.join(source_dir, name)
            dst = os.path.join(target, name)
            if os.path.isfile(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
                shutil.copyfile(src, dst)
    tmp = record_path(workdir) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, record_path(workdir))


def load_config(workdir: str) -> ConfigDict:
    """The recorded config; a tokenizer.json is read from the run directory's copy."""
    from zaya_jax.train.errors import TrainConfigError

    if not exists(workdir):
        raise TrainConfigError(f"{workdir} has no {RUN_RECORD} (runs record their config at the first start); "
                               f"pass --config")
    record = read(workdir)
    config = ConfigDict(record["config"])
    if record["tokenizer"]["kind"] == "hf":
        config.data.tokenizer = os.path.join(os.path.abspath(workdir), record["tokenizer"]["file"])
    return config


def recorded_tokenizer(path: str) -> str | None:
    """The tokenizer spec of the run holding checkpoint folder `path` ('byte' or its tokenizer.json copy), None
    when `path` is no recorded run."""
    run = run_directory(path)
    if not exists(run):
        return None
    tok = read(run)["tokenizer"]
    return "byte" if tok["kind"] == "byte" else os.path.join(run, tok["file"])


def default_tokenizer(checkpoint: str) -> str:
    """The tokenizer a checkpoint was trained with: a Hugging Face directory's own files, or a run's record."""
    from zaya_jax.checkpoint.manager import CheckpointError
    from zaya_jax.inference.loading import is_hf_directory

    if is_hf_directory(checkpoint):
        return checkpoint
    spec = recorded_tokenizer(checkpoint)
    if spec is None:
        raise CheckpointError(f"{checkpoint}: no {RUN_RECORD} says which tokenizer trained this run; pass --tokenizer")
    return spec

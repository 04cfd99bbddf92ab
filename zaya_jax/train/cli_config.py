"""The run config from the command line: ml-collections flags plus the open dictionaries it cannot fill.

A config file's `data.sources`, `data.valid_sources`, `data.weights` and `model.overrides` start (nearly) empty,
and ml-collections refuses keys a locked config does not already have (`--config.data.sources.web=P` ->
AttributeError). `split_open_flags` takes those flags out of argv before absl parses it; `resolve` then sets them,
typed (weights as floats, model overrides by their ModelConfig field type), and settles `data.builtin`: naming
sources turns the built-in corpus off, or is refused when `--config.data.builtin=True` is given as well.
Without `--config`, a run directory's recorded config (run_record.py) is the base, so a resume repeats nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from ml_collections import ConfigDict

from zaya_jax.config import ConfigError, ModelConfig

OPEN = ("data.sources", "data.valid_sources", "data.weights", "model.overrides")
_OPEN_FLAG = re.compile(r"^--?config\.(data\.sources|data\.valid_sources|data\.weights|model\.overrides)"
                        r"\.([A-Za-z_][A-Za-z0-9_.]*)(?:=(.*))?$", re.S)
_BUILTIN_FLAG = re.compile(r"^--?(no)?config\.data\.builtin(=|$)")
_MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


@dataclasses.dataclass
class OpenFlags:
    """The flags taken out of argv: (section, key, raw value) in command-line order."""

    values: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    builtin_given: bool = False  # --config.data.builtin appeared on the command line


def split_open_flags(argv: list[str]) -> tuple[list[str], OpenFlags]:
    """argv without the open-dictionary flags (`--config.data.sources.NAME=V` or `... NAME V`), and those flags."""
    rest, found = [], OpenFlags()
    i = 0
    while i < len(argv):
        arg = argv[i]
        m = _OPEN_FLAG.match(arg)
        nested = m and "." in m.group(2)
        if nested and m.group(1) != "model.overrides":
            m = None  # a source name has no dots
        if m and (m.group(1) != "model.overrides" or m.group(2).split(".")[0] in _MODEL_FIELDS
                  or (m.group(3) is not None and not nested)):
            value = m.group(3)
            if value is None:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{arg}: no value given")
                value, i = argv[i + 1], i + 1
            found.values.append((m.group(1), m.group(2), value))
        else:
            found.builtin_given |= bool(_BUILTIN_FLAG.match(arg))
            rest.append(arg)
        i += 1
    return rest, found


def model_field_value(name: str, raw: str):
    """`raw` as the type of ModelConfig field `name` (int, float, bool, str, None, tuples/dicts as literals);
    `rope.TYPE.theta` / `rope.TYPE.partial_rotary_factor` as floats."""
    if name.startswith("rope.") and name.count(".") == 2 and name.endswith((".theta", ".partial_rotary_factor")):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"--config.model.overrides.{name}={raw}: not a number") from None
    field = _MODEL_FIELDS.get(name)
    if field is None:
        raise ConfigError(f"--config.model.overrides.{name}: ModelConfig has no field {name!r}")
    kind = str(field.type)
    text = raw.strip()
    try:
        if "None" in kind and text.lower() in ("none", "null"):
            return None
        if kind == "str":
            return raw
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError("expected true or false")
            return text.lower() in ("true", "1")
        if kind.startswith("int") and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if kind == "float":
            return float(text)
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"--config.model.overrides.{name}={raw}: not a value of type {kind} ({e})") from None


def resolve(config: ConfigDict, open_flags: OpenFlags | None = None) -> ConfigDict:
    """Sets the open-dictionary flags on `config` and settles data.builtin (in place; returns `config`)."""
    from zaya_jax.data.corpus import SOURCES
    from zaya_jax.train.errors import TrainConfigError

    open_flags = open_flags or OpenFlags()
    # the file's weights are the built-in corpus's when it was on, also when --config.data.builtin=False turned it
    # off before this runs (its weights still name the built-in sources, which named sources replace)
    was_builtin = bool(config.data.builtin) or (open_flags.builtin_given and set(config.data.weights) == set(SOURCES))
    given = {section: {} for section in OPEN}
    for section, key, raw in open_flags.values:
        if section == "model.overrides":
            value = model_field_value(key, raw)
        elif section == "data.weights":
            try:
                value = float(raw)
            except ValueError:
                raise TrainConfigError(f"--config.data.weights.{key}={raw}: not a number") from None
        else:
            value = raw
        given[section][key] = value
    for section, values in given.items():
        if not values:
            continue
        parent, name = section.split(".")
        for key, value in values.items():
            *path, leaf = key.split(".")  # rope.hybrid.theta: the parents are created as needed
            node = config[parent][name]
            for p in path:
                if p not in node:
                    with node.unlocked():
                        node[p] = ConfigDict()
                node = node[p]
            with node.unlocked():
                if leaf in node:
                    del node[leaf]  # a new type (an int where the file had a float, a whole dict) is accepted
                node[leaf] = value
    if config.data.sources and config.data.builtin:
        if open_flags.builtin_given:
            raise TrainConfigError("--config.data.builtin=True contradicts data.sources "
                                   f"({', '.join(sorted(config.data.sources))}): give one or the other")
        config.data.builtin = False  # named sources replace the built-in corpus
    if was_builtin and not config.data.builtin and given["data.weights"]:
        # the file's weights were the built-in corpus's: weights named on the command line replace them
        with config.data.weights.unlocked():
            for name in set(config.data.weights) - set(given["data.weights"]) - set(config.data.sources):
                del config.data.weights[name]
    if (was_builtin or not config.data.weights) and not config.data.builtin and not given["data.weights"] \
            and set(config.data.weights) != set(config.data.sources):
        # the file's weights were the built-in corpus's (or none): the named sources are mixed equally
        with config.data.unlocked():
            config.data.weights = ConfigDict({name: 1.0 for name in config.data.sources})
    if config.data.builtin and not config.data.weights:
        # the built-in corpus switched on over a config without weights (one made for named sources): mixed equally
        with config.data.unlocked():
            config.data.weights = ConfigDict({name: 1.0 for name in SOURCES})
    if config.data.builtin and (given["data.valid_sources"] or config.data.valid_sources):
        raise TrainConfigError("data.valid_sources needs data.sources: the built-in corpus has its own held-out "
                               "split")
    return config


def apply_overrides(config: ConfigDict, overrides: dict) -> ConfigDict:
    """Sets ml-collections' parsed `--config.a.b=V` values (path -> value) on another config (a recorded one)."""
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        with node.unlocked():
            node[leaf] = value
    return config


def recorded_base(argv: list[str], default_workdir: str) -> ConfigDict | None:
    """Without --config in argv: the config recorded in the run directory argv's --workdir (else `default_workdir`)
    names, if it holds run.json. The launchers define their --config flag on it, so that a resume's --config.X
    overrides are read against the keys that run has (its config file's, not configs/default.py's)."""
    from zaya_jax.train import run_record

    if any(re.match(r"^--?config(=|$)", a) for a in argv):
        return None
    workdir = default_workdir
    for i, arg in enumerate(argv):
        m = re.match(r"^--?workdir(?:=(.*))?$", arg, re.S)
        if m:
            workdir = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else workdir)
    return run_record.load_config(workdir) if run_record.exists(workdir) else None


def define_config_flag(default_file: str, argv: list[str], default_workdir: str, help_text: str, **flag_values):
    """absl's --config flag: the file --config names (default `default_file`), or on a resume without --config the
    run's recorded config (recorded_base); ml-collections applies the --config.X overrides when it is defined.
    flag_values: absl's flag_values= and sys_argv= (tests)."""
    from ml_collections import config_flags

    recorded = recorded_base(argv, default_workdir)
    flag_values.setdefault("sys_argv", split_open_flags(argv)[0])  # the open flags are resolve()'s
    if recorded is None:
        config_flags.DEFINE_config_file("config", default_file, help_text, lock_config=True, **flag_values)
    else:
        config_flags.DEFINE_config_dict("config", recorded, help_text, lock_config=True, **flag_values)


def command_line_config(flag, open_flags: OpenFlags, workdir: str | None = None) -> ConfigDict:
    """The run's config from absl's parsed `--config` flag object: the file given with --config (its flags
    applied), or without --config the config recorded in `workdir` with the command line's overrides on top."""
    from ml_collections import config_flags

    from zaya_jax.train import run_record

    config = flag.value
    if not flag.present and workdir and run_record.exists(workdir):
        config = apply_overrides(run_record.load_config(workdir), config_flags.get_override_values(flag))
    return resolve(config, open_flags)

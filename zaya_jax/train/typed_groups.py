"""A config group (a ConfigDict or dict) as a frozen dataclass: unknown keys refused, missing keys given the field's
default (or refused when it has none), every value checked against the field's annotation. Errors are one line
naming the key and the bad value (TrainConfigError). Used by train/options.py for every group of the run config."""

from __future__ import annotations

import dataclasses
import types
import typing

import numpy as np

from zaya_jax.train.errors import TrainConfigError


def is_mapping(v) -> bool:
    """A dict, a ConfigDict or a FrozenConfigDict (ConfigDict is no collections.abc.Mapping)."""
    return hasattr(v, "keys") and hasattr(v, "items") and not isinstance(v, (str, bytes))


def as_dict(v) -> dict:
    return dict(v.items()) if v is not None else {}


def build(cls, group: str, values) -> typing.Any:
    """cls(**values) for the dataclass `cls`, checked; `group` names the config group in messages ('train')."""
    if values is not None and not is_mapping(values):
        raise TrainConfigError(f"{group}={values!r} must be a group of keys")
    values = as_dict(values)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TrainConfigError(f"{group}: unknown key{'s' if len(unknown) > 1 else ''} "
                               f"{', '.join(map(repr, unknown))} (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    kw = {}
    for name, f in fields.items():
        if name in values:
            kw[name] = typed(f"{group}.{name}", values[name], hints[name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TrainConfigError(f"{group}.{name} is missing (it has no default)")
    return cls(**kw)


def typed(key: str, v, kind):
    """`v` as `kind` (bool, int, float, str, X | None, dict[str, X], a dataclass), or TrainConfigError. ints are
    accepted for floats; bools are not accepted as numbers; numpy scalars become Python ones."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        if v is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return typed(key, v, rest[0])
        for a in rest:  # the first member the value fits
            try:
                return typed(key, v, a)
            except TrainConfigError:
                pass
        raise TrainConfigError(f"{key}={v!r} must be one of {' | '.join(_name(a) for a in args)}")
    if dataclasses.is_dataclass(kind):
        return build(kind, key, v)
    if origin is dict:
        if not is_mapping(v):
            raise TrainConfigError(f"{key}={v!r} must be a group of keys")
        return {str(k): typed(f"{key}.{k}", x, args[1]) for k, x in v.items()}
    if kind is typing.Any:
        return v
    boolean = isinstance(v, (bool, np.bool_))
    if kind is bool and boolean:
        return bool(v)
    if kind is int and isinstance(v, (int, np.integer)) and not boolean:
        return int(v)
    if kind is float and isinstance(v, (int, float, np.integer, np.floating)) and not boolean:
        return float(v)
    if kind is str and isinstance(v, str):
        return v
    raise TrainConfigError(f"{key}={v!r} must be {_name(kind)}")


def _name(kind) -> str:
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            type(None): "None"}.get(kind, getattr(kind, "__name__", str(kind)))

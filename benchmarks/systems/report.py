"""Writing results: one JSON per sweep (with the device it ran on) and a compact fixed-width table."""

from __future__ import annotations

import json
import os

from benchmarks.systems.timing import device_summary


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": device_summary(), **payload}, f, indent=1, default=_plain)
    return path


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "as_dict"):
        return v.as_dict()
    return str(v)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec such as '.2f' or '' for str()). Missing values print as '-'."""
    def cell(row, key, spec):
        v = row.get(key)
        if v is None:
            return "-"
        return format(v, spec) if spec else str(v)

    cells = [[cell(r, k, s) for k, _, s in columns] for r in rows]
    heads = [h for _, h, _ in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]

    def line(values):
        return "  ".join(v.rjust(w) for v, w in zip(values, widths))

    return "\n".join([line(heads)] + [line(c) for c in cells])

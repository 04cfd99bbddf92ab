"""Bytes each device receives in the collectives of a compiled XLA program (read from its HLO text).

Per collective, with G devices in its replica group and a ring/pairwise algorithm (sizes from the result
shape, since compiled HLO prints operands without types):
    all-gather:          result · (G-1)/G          (the G-1 shards it did not have)
    reduce-scatter:      result · (G-1)            (operand = G · result)
    all-to-all:          result · (G-1)/G          (it keeps its own 1/G)
    all-reduce:          2 · result · (G-1)/G      (reduce-scatter + all-gather)
    collective-permute:  result                    (when it is a receiver)
Replica groups are read in the explicit ({{0,1},{2,3}}), iota ([2,4]<=[8]) and mesh (mesh['data'=8,..] {'data'})
forms. Async pairs are counted once, at their -start op (whose result is taken as its last tuple element).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(ELEMENT_BYTES) + r")\[([\d,]*)\]")
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<operands>.*?)\)"
                 r"(?P<attrs>,.*)?$")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    result_bytes: int
    group: int
    axes: tuple[str, ...] = ()  # the mesh axes of its replica groups, when the HLO names them

    @property
    def received_bytes(self) -> float:
        g, r = self.group, self.result_bytes
        if self.kind == "collective-permute":
            return float(r)
        if self.kind == "reduce-scatter":
            return float(r * (g - 1))
        share = (g - 1) / g if g else 0.0
        return (2 if self.kind == "all-reduce" else 1) * r * share


def _shape_bytes(text: str) -> list[int]:
    return [ELEMENT_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text)]


def _groups(attrs: str, default: int) -> tuple[int, tuple[str, ...]]:
    """(replica group size, mesh axes of the groups if named)."""
    m = _GROUPS_LIST.search(attrs)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x]), ()
    m = _GROUPS_IOTA.search(attrs)
    if m:
        return int(m.group(2)), ()
    m = _GROUPS_MESH.search(attrs)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
        axes = tuple(a.strip("' ") for a in m.group(2).split(",") if a.strip())
        return math.prod(sizes[a] for a in axes), axes
    return default, ()


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        sizes = _shape_bytes(m.group("result"))
        result = sizes[-1] if m.group("start") else sum(sizes)
        out.append(Collective(m.group("kind"), result, *_groups(m.group("attrs") or "", num_devices)))
    return out


def received_by_kind(hlo_text: str, num_devices: int) -> dict[str, float]:
    """{kind: bytes one device receives per call of the program}."""
    total = collections.Counter()
    for c in collectives(hlo_text, num_devices):
        total[c.kind] += c.received_bytes
    return dict(total)


def received_by_axes(hlo_text: str, num_devices: int) -> dict[tuple[str, ...], float]:
    """{mesh axes of the replica groups: bytes one device receives over them per call} (e.g. in-node vs rail)."""
    total = collections.Counter()
    for c in collectives(hlo_text, num_devices):
        total[c.axes] += c.received_bytes
    return dict(total)

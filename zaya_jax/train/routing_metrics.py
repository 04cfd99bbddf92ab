"""Routing health as logged metrics: the step's per-layer figures (`routing/NAME`, arrays [L]) become one scalar
per layer (`routing/NAME/layer_NN`) plus the worst layer's value under the plain name (`max_load`, `min_load`,
`dead_experts`, `skip_fraction`, `moved`), which the console shows; and the per-layer table of a logged row."""

from __future__ import annotations

import numpy as np

PREFIX = "routing/"
# the worst layer of each figure that has a bad direction
WORST = {"max_load": np.max, "min_load": np.min, "dead_experts": np.max, "skip_fraction": np.max, "moved": np.max}
COLUMNS = ("max_load", "min_load", "dead_experts", "top1_prob", "entropy", "spread", "skip_fraction", "moved")


def flatten(metrics: dict) -> dict[str, float]:
    """{name: scalar or [L] array} -> {name: float}, per-layer arrays expanded as above."""
    out = {}
    for name, value in metrics.items():
        value = np.asarray(value, np.float64)
        if not name.startswith(PREFIX) or value.ndim == 0:
            out[name] = float(value)
            continue
        figure = name[len(PREFIX):]
        for layer, v in enumerate(value):
            out[f"{name}/layer_{layer:02d}"] = float(v)
        if figure in WORST:
            out[figure] = float(WORST[figure](value))
    return out


def layer_table(row: dict) -> str:
    """The per-layer routing table of one metrics.jsonl row."""
    layers = sorted({int(k.rsplit("_", 1)[1]) for k in row if k.startswith(PREFIX) and "/layer_" in k})
    if not layers:
        raise ValueError(f"step {row.get('step')}: the row has no per-layer routing metrics")
    head = f"{'layer':>5} " + " ".join(f"{c:>13}" for c in COLUMNS)
    lines = [head]
    for layer in layers:
        cells = [row.get(f"{PREFIX}{c}/layer_{layer:02d}", float("nan")) for c in COLUMNS]
        lines.append(f"{layer:>5} " + " ".join(f"{v:>13.4g}" for v in cells))
    return "\n".join(lines)


__all__ = ["flatten", "layer_table", "PREFIX", "COLUMNS"]

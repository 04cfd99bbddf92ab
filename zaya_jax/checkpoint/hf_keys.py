"""The map between our parameter tree and Hugging Face ZAYA checkpoint keys.

Our tree follows the HF names with per-layer leaves stacked on a leading layer axis, so the map is a rename plus
a stack/unstack and never a transpose:

    model/layers/<rest>        [L, ...]     <->  model.layers.{l}.<rest>                       for l in 0..L-1
    model/router_states_scale  [L-1, R]     <->  model.layers.{l}.mlp.gate.router_states_scale  for l in 1..L-1
    everything else            [...]        <->  the same path joined with dots

The map is derived from the (abstract) model state, so a parameter added to the model is mapped without edits here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

_LAYERS = ("model", "layers")
_EDA_SCALE = ("model", "router_states_scale")


@dataclasses.dataclass(frozen=True)
class HFTensor:
    key: str  # HF checkpoint key
    path: tuple[str, ...]  # path of our (possibly stacked) leaf in the nnx state
    index: int | None  # position along our leaf's leading layer axis; None = the whole leaf
    shape: tuple[int, ...]  # shape of the HF tensor


def hf_tensors(flat_state: Iterable[tuple[tuple, object]]) -> list[HFTensor]:
    """Every HF tensor of the model whose flat nnx state is given ((path, Variable) pairs, abstract or concrete),
    in checkpoint order (global tensors first, then layer by layer)."""
    out = []
    for path, var in flat_state:
        path = tuple(str(p) for p in path)
        shape = tuple(var.shape)
        if path[:2] == _LAYERS:
            rest = ".".join(path[2:])
            out += [HFTensor(f"model.layers.{l}.{rest}", path, l, shape[1:]) for l in range(shape[0])]
        elif path == _EDA_SCALE:  # layer 0 has no EDA scale: row i belongs to layer i + 1
            out += [HFTensor(f"model.layers.{i + 1}.mlp.gate.router_states_scale", path, i, shape[1:])
                    for i in range(shape[0])]
        else:
            out.append(HFTensor(".".join(path), path, None, shape))
    return sorted(out, key=lambda t: _natural_key(t.key))


def _natural_key(key: str):
    """model.layers.2.x sorts before model.layers.10.x; non-layer keys first."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
    return (1, int(m.group(1)), m.group(2)) if m else (0, 0, key)

"""Device meshes laid out on a rails-only cluster: nodes x GPUs per node.

The GPU with local rank r on every node sits on rail r, so traffic between nodes should only ever pair GPUs of
the same local rank. Devices are arranged [node, local] (one process per node, or one process's devices cut into
emulated nodes with `local_per_node`). Every node's local GPUs are split, outermost first, into
    data_local x expert x tensor x context
and the mesh axes are ('data', 'expert', 'tensor', 'context') with data = nodes x data_local, node-major. So
`context` (and `tensor`, `expert`, reserved for later: ZAYA1 trained without them) never leaves a node, and a
reduction over `data` can be split into an intra-node part and a cross-node part on each rail
(collectives.py: hierarchical reduce). Parallel degrees should divide a node (spec 13: xGMI reaches full
bandwidth only when the whole node takes part).
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "expert", "tensor", "context")


class MeshError(ValueError):
    pass


def node_grid(devices=None) -> np.ndarray:
    """Devices as [nodes, local], nodes ordered by process index, local GPUs by local id."""
    devices = list(jax.devices() if devices is None else devices)
    by_process = collections.defaultdict(list)
    for d in devices:
        by_process[d.process_index].append(d)
    sizes = {len(v) for v in by_process.values()}
    if len(sizes) != 1:
        raise MeshError(f"every node must contribute the same number of devices, got {sorted(sizes)}")
    return np.array([sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)], dtype=object)


def emulated_grid(devices, local_per_node: int) -> np.ndarray:
    """One process's devices re-cut into emulated nodes of `local_per_node` (tests of the rails layout)."""
    grid = node_grid(devices)
    if local_per_node < 1 or grid.size % local_per_node or grid.shape[1] % local_per_node:
        raise MeshError(f"local_per_node={local_per_node} must divide each process's {grid.shape[1]} devices")
    return grid.reshape(-1, local_per_node)


def make_mesh(data: int = -1, context: int = 1, devices=None, num_devices: int = 0, *, expert: int = 1,
              tensor: int = 1, local_per_node: int = 0) -> Mesh:
    """Mesh with axes ('data', 'expert', 'tensor', 'context'); data=-1 takes every device the others leave.
    num_devices > 0 uses only the first n devices (e.g. to resume on fewer emulated devices); local_per_node > 0
    cuts one process's devices into emulated nodes."""
    if num_devices:
        devices = list(jax.devices() if devices is None else devices)[:num_devices]
    grid = emulated_grid(devices, local_per_node) if local_per_node else node_grid(devices)
    nodes, local = grid.shape
    inner = expert * tensor * context
    if min(expert, tensor, context) < 1 or local % inner:
        raise MeshError(f"expert={expert} x tensor={tensor} x context={context} must divide the {local} devices of "
                        f"a node (rails-only: these axes stay inside a node)")
    data_avail = nodes * local // inner
    if data == -1:
        data = data_avail
    if data != data_avail:
        raise MeshError(f"data={data} x expert={expert} x tensor={tensor} x context={context} must use all "
                        f"{nodes * local} devices ({nodes} nodes x {local}); use data=-1")
    arranged = grid.reshape(data, expert, tensor, context)
    return Mesh(arranged, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe_mesh(mesh: Mesh, local_per_node: int = 0) -> str:
    """One line for the shape, then each node's devices: local rank (= rail) -> mesh coordinates."""
    shape = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    flat = list(mesh.devices.flat)
    per_node = local_per_node or sum(d.process_index == flat[0].process_index for d in flat)
    nodes = len(flat) // per_node
    lines = [(f"mesh ({shape}) over {len(flat)} {flat[0].platform} devices on {nodes} node(s) x {per_node}; "
              f"rails-only: cross-node traffic pairs equal local ranks")]
    coords = {d: idx for idx, d in np.ndenumerate(mesh.devices)}
    for n in range(nodes):
        cells = []
        for r, d in enumerate(flat[n * per_node:(n + 1) * per_node]):
            c = coords[d]
            named = ",".join(f"{a[0]}{i}" for a, i in zip(mesh.axis_names, c) if mesh.shape[a] > 1) or "-"
            cells.append(f"r{r}:{d.id}({named})")
        lines.append(f"  node {n}: " + " ".join(cells))
    return "\n".join(lines)

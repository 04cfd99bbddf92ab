"""Device meshes laid out on a rails-only cluster: nodes x GPUs per node.

The GPU with local rank r on every node sits on rail r, so traffic between nodes should only ever pair GPUs of
the same local rank. Devices are arranged [node, local] (one process per node, or the CPU's emulated devices as
one node); the `context` axis is carved out of a node's local GPUs (so context-parallel exchanges stay inside a
node), and `data` spans the rest: node-major, so a reduction over `data` groups each node's GPUs first.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


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


def make_mesh(data: int = -1, context: int = 1, devices=None, num_devices: int = 0) -> Mesh:
    """Mesh with axes ('data', 'context'); data=-1 takes every device the context axis leaves. num_devices > 0
    uses only the first n devices (e.g. to resume on fewer emulated devices)."""
    if num_devices:
        devices = list(jax.devices() if devices is None else devices)[:num_devices]
    grid = node_grid(devices)
    nodes, local = grid.shape
    if context < 1 or local % context:
        raise MeshError(f"context={context} must divide the {local} devices of a node (rails-only: context "
                        f"parallel stays inside a node)")
    data_avail = nodes * local // context
    if data == -1:
        data = data_avail
    if data != data_avail:
        raise MeshError(f"data={data} x context={context} must use all {nodes * local} devices ({nodes} nodes x "
                        f"{local}); use data=-1")
    arranged = grid.reshape(nodes, local // context, context).reshape(data, context)
    return Mesh(arranged, ("data", "context"), axis_types=(AxisType.Auto, AxisType.Auto))


def describe_mesh(mesh: Mesh) -> str:
    nodes = len({d.process_index for d in mesh.devices.flat})
    shape = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return f"mesh ({shape}) over {mesh.devices.size} {mesh.devices.flat[0].platform} devices on {nodes} node(s)"

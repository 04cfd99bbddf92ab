"""Which devices a collective runs over, on a rails-only cluster laid out as [nodes, local GPUs].

Three scopes, each a mesh ('others', 'node', 'local') whose collective runs over some of the axes while 'others'
enumerates the independent groups that run at the same time:
    node    k GPUs inside a node (every node runs its own group): the xGMI / NVLink fabric
    rail    m nodes over one rail (local rank 0 of each node): the scale-out NIC of one GPU
    global  m whole nodes (m x local GPUs): what a data-parallel gradient reduction crosses
Every node takes part in every mesh, so the same program runs in each process of a multi-node job.
One process's CPU devices can stand in for several nodes (`local_per_node`), which is how the tests exercise the
rail and global scopes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zaya_jax.parallel.mesh import node_grid

AXES = ("others", "node", "local")
SCOPES = ("node", "rail", "global")


@dataclasses.dataclass(frozen=True)
class Group:
    scope: str
    mesh: Mesh
    axes: tuple[str, ...]  # mesh axes the collective reduces / gathers over

    @property
    def n(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.axes]))

    @property
    def label(self) -> str:
        return f"{self.scope} x{self.n}"


def layout(local_per_node: int | None = None, devices=None) -> np.ndarray:
    """Devices as [nodes, local]: one row per process, or the flat device list re-cut into rows of
    `local_per_node` (emulated nodes)."""
    if local_per_node is None:
        return node_grid(devices)
    flat = list(jax.devices() if devices is None else devices)
    if local_per_node < 1 or len(flat) % local_per_node:
        raise ValueError(f"local_per_node={local_per_node} must divide the {len(flat)} devices")
    return np.array(flat, dtype=object).reshape(-1, local_per_node)


def counts_up_to(limit: int) -> list[int]:
    """2, 4, 8, ... <= limit, and limit itself."""
    out, v = [], 2
    while v <= limit:
        out.append(v)
        v *= 2
    if limit >= 2 and out[-1] != limit:
        out.append(limit)
    return out


def _mesh(devices_3d: np.ndarray) -> Mesh:
    return Mesh(devices_3d, AXES, axis_types=(AxisType.Auto,) * 3)


def groups(grid: np.ndarray, scopes=SCOPES, all_rails: bool = False) -> list[Group]:
    nodes, local = grid.shape
    out = []
    if "node" in scopes:
        for k in counts_up_to(local):
            out.append(Group("node", _mesh(grid[:, :k].reshape(nodes, 1, k)), ("local",)))
    if "rail" in scopes:
        rails = grid if all_rails else grid[:, :1]
        for m in (c for c in counts_up_to(nodes) if nodes % c == 0):
            out.append(Group("rail", _mesh(rails.reshape(nodes // m, m, rails.shape[1])), ("node",)))
    if "global" in scopes:
        for m in (c for c in counts_up_to(nodes) if nodes % c == 0):
            out.append(Group("global", _mesh(grid.reshape(nodes // m, m, local)), ("node", "local")))
    return out

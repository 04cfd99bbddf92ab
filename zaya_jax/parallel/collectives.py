"""Hierarchical data-parallel reductions for a rails-only cluster: inside the node first, then across nodes on
each rail.

A flat reduction over `data` treats all nodes x local devices as one ring. The hierarchical form splits it:
  1. reduce-scatter inside each node (xGMI / NVLink): in-node device l keeps 1/local of the node's sum;
  2. the cross-node step on each rail: the devices with in-node index l (one per node, all on NIC rail l)
     reduce that share (all-reduce for a full sum, reduce-scatter for ZeRO-1);
  3. (full sum only) all-gather inside the node.
Every byte that leaves a node travels between equal local ranks, i.e. on one rail, and each NIC carries only
1/local of the data. These run inside shard_map over `hierarchical_view(mesh)`, whose 'data' axis is split into
('node', 'data_local') over the same devices in the same order; `inner` names the in-node axes reduced in
step 1 (data_local, and context when the batch is also split over it). On a single node the cross-node step is
over one device and costs nothing.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh

NODE, LOCAL = "node", "data_local"


def hierarchical_view(mesh: Mesh, nodes: int | None = None) -> Mesh:
    """The mesh's devices with 'data' split into (node, data_local), node-major as make_mesh lays them out.
    nodes: default one per process (pass it for emulated nodes)."""
    nodes = nodes or len({d.process_index for d in mesh.devices.flat})
    data = mesh.shape["data"]
    if data % nodes:
        raise ValueError(f"data={data} does not split over {nodes} nodes")
    devices = mesh.devices.reshape(nodes, data // nodes, *mesh.devices.shape[1:])
    names = (NODE, LOCAL) + tuple(a for a in mesh.axis_names if a != "data")
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _inner_size(inner) -> int:
    return math.prod(lax.axis_size(a) for a in inner)


def hierarchical_psum(x, inner=(LOCAL,)):
    """psum over (node, *inner): reduce-scatter in the node, all-reduce on the rail, all-gather in the node."""
    flat = x.reshape(-1)
    n = flat.shape[0]
    flat = jnp.pad(flat, (0, -n % _inner_size(inner)))
    share = lax.psum_scatter(flat, inner, scatter_dimension=0, tiled=True)
    share = lax.psum(share, NODE)
    return lax.all_gather(share, inner, axis=0, tiled=True, to="invarying")[:n].reshape(x.shape)


def hierarchical_psum_scatter(x, inner=(LOCAL,), dim: int = 0):
    """psum_scatter over (node, *inner) along `dim`: a reduce-scatter in the node, then one on the rail. The device
    at (node n, inner index i) ends with shard n·|inner| + i: the layout of PartitionSpec(('data', ...))."""
    nodes, local = lax.axis_size(NODE), _inner_size(inner)
    x = jnp.moveaxis(x, dim, 0)
    if x.shape[0] % (nodes * local):
        raise ValueError(f"dim {dim} ({x.shape[0]}) must split into {nodes * local} shards")
    chunk = x.shape[0] // (nodes * local)
    # reorder shards (node, inner) -> (inner, node) so the in-node step hands device i every node's shard i
    by_local = x.reshape(nodes, local, chunk, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    share = lax.psum_scatter(by_local, inner, scatter_dimension=0, tiled=True)
    return jnp.moveaxis(lax.psum_scatter(share, NODE, scatter_dimension=0, tiled=True), 0, dim)

"""Hierarchical data-parallel reductions for a rails-only cluster: inside the node first, then across nodes on
each rail.

A flat reduction over `data` treats all nodes x local devices as one ring. The hierarchical form splits it:
  1. reduce-scatter inside each node (xGMI / NVLink): local device l keeps 1/local of the node's sum;
  2. the cross-node step on each rail: the devices with local index l (one per node, all on NIC rail l) reduce
     that 1/local share (all-reduce for a full sum, reduce-scatter for ZeRO-1);
  3. (full sum only) all-gather inside the node.
Every byte that leaves a node travels between equal local ranks, i.e. on one rail, and each NIC carries only
1/local of the data. These run inside shard_map over `hierarchical_view(mesh)`, whose 'data' axis is split into
('node', 'data_local') over the same devices in the same order.
"""

from __future__ import annotations

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


def hierarchical_psum(x):
    """psum over (node, data_local), as reduce-scatter in the node, all-reduce on the rail, all-gather in the node."""
    local = lax.axis_size(LOCAL)
    flat = x.reshape(-1)
    n = flat.shape[0]
    flat = jnp.pad(flat, (0, -n % local))
    share = lax.psum_scatter(flat, LOCAL, scatter_dimension=0, tiled=True)
    share = lax.psum(share, NODE)
    return lax.all_gather(share, LOCAL, axis=0, tiled=True)[:n].reshape(x.shape)


def hierarchical_psum_scatter(x):
    """psum_scatter over (node, data_local) along dim 0, as a reduce-scatter in the node, then one on the rail.
    Device (node n, local l) ends with shard n·local + l, the layout of PartitionSpec('data')."""
    nodes, local = lax.axis_size(NODE), lax.axis_size(LOCAL)
    if x.shape[0] % (nodes * local):
        raise ValueError(f"dim 0 ({x.shape[0]}) must split into {nodes * local} shards")
    chunk = x.shape[0] // (nodes * local)
    # reorder shards (node, local) -> (local, node) so the in-node step hands local l every node's shard l
    by_local = x.reshape(nodes, local, chunk, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    share = lax.psum_scatter(by_local, LOCAL, scatter_dimension=0, tiled=True)
    return lax.psum_scatter(share, NODE, scatter_dimension=0, tiled=True)

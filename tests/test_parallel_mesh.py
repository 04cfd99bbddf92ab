"""The rails-only mesh on 8 emulated CPU devices cut into 2 nodes x 4: axis layout (context, tensor and expert inside
a node, data node-major), the start-up layout print, and hierarchical reductions that equal the flat ones while
their compiled collectives run inside the node first and then only between equal local ranks (one rail)."""

import re

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.collectives import (
    LOCAL,
    NODE,
    hierarchical_psum,
    hierarchical_psum_scatter,
    hierarchical_view,
)
from zaya_jax.parallel.mesh import MeshError, describe_mesh, make_mesh


def test_inner_axes_stay_inside_a_node_and_data_is_node_major():
    mesh = make_mesh(context=2, tensor=2, local_per_node=4)
    assert dict(mesh.shape) == {"data": 2, "expert": 1, "tensor": 2, "context": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    for data in range(2):  # every (tensor, context) group is one node's 4 devices
        assert sorted(ids[data].ravel().tolist()) == list(range(4 * data, 4 * data + 4))
    layout = describe_mesh(mesh, local_per_node=4)
    assert "on 2 node(s) x 4" in layout
    assert "node 1: r0:4(d1,t0,c0) r1:5(d1,t0,c1) r2:6(d1,t1,c0) r3:7(d1,t1,c1)" in layout
    with pytest.raises(MeshError, match="inside a node"):
        make_mesh(context=8, local_per_node=4)


def test_hierarchical_reductions_equal_flat_ones_and_cross_nodes_only_on_rails():
    view = hierarchical_view(make_mesh(local_per_node=4), nodes=2)
    assert dict(view.shape)[NODE] == 2 and dict(view.shape)[LOCAL] == 4
    both = (NODE, LOCAL)
    x = jax.random.normal(jax.random.key(0), (8, 16, 3))

    def body(x):
        x = x[0]
        return (hierarchical_psum(x)[None], lax.psum(x, both)[None], hierarchical_psum_scatter(x)[None],
                lax.psum_scatter(x, both, tiled=True)[None])

    f = jax.jit(jax.shard_map(body, mesh=view, in_specs=P(both), out_specs=P(both)))
    summed, flat_sum, scattered, flat_scattered = f(x)
    np.testing.assert_allclose(summed, flat_sum, atol=1e-5)
    np.testing.assert_allclose(scattered, flat_scattered, atol=1e-5)

    def groups_of(kind):  # the mesh axes each collective of `kind` runs over
        hlo = jax.jit(jax.shard_map(lambda x: kind_fn[kind](x[0])[None], mesh=view, in_specs=P(both),
                                    out_specs=P(both))).lower(x).compile().as_text()
        return re.findall(r"(all-reduce|reduce-scatter|all-gather)\(.*?replica_groups=mesh\[[^\]]*\] \{([^}]*)\}",
                          hlo)

    kind_fn = {"sum": hierarchical_psum, "scatter": hierarchical_psum_scatter}
    assert groups_of("sum") == [("reduce-scatter", "'data_local'"), ("all-reduce", "'node'"),
                                ("all-gather", "'data_local'")]
    assert groups_of("scatter") == [("reduce-scatter", "'data_local'"), ("reduce-scatter", "'node'")]

"""Pallas kernels inside `jax.shard_map(check_vma=True)`: the varying-mesh-axes types of their inputs and outputs.

Under check_vma every value records the manual mesh axes it varies over, and a `pallas_call` needs
  * an explicit type on each output struct (`jax.ShapeDtypeStruct(..., manual_axis_type=...)`), and
  * one type shared by all of its inputs.
So a kernel wrapper makes every input varying over the union of its inputs' axes (`vary_to_union`) and gives its
outputs that type (`out_struct`); a custom VJP sums each gradient over the axes its primal did not vary over
(`sum_to_type_of`), which is how autodiff transposes the implicit broadcast of an invariant value (e.g. a
replicated norm weight, or K/V gathered whole onto every context-parallel device) for ordinary primitives.
Outside shard_map all of this is a no-op.
"""

from __future__ import annotations

import jax


def varying_axes(a) -> frozenset:
    """Mesh axes `a` varies over inside shard_map (empty outside it, and for None / NumPy constants)."""
    if a is None:
        return frozenset()
    return frozenset(getattr(getattr(jax.typeof(a), "mat", None), "varying", ()))


def union_axes(*arrays) -> frozenset:
    return frozenset().union(*map(varying_axes, arrays))


def vary(a, axes: frozenset):
    """`a` made varying over `axes` (None and already-varying values pass through unchanged)."""
    missing = tuple(sorted(axes - varying_axes(a)))
    return a if a is None or not missing else jax.lax.pcast(a, missing, to="varying")


def vary_to_union(*arrays):
    """All arrays (None entries kept) made varying over the union of their axes: one type for a kernel's inputs."""
    axes = union_axes(*arrays)
    return [vary(a, axes) for a in arrays]


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel's output struct; inside shard_map it varies over what `like` (an input of the call, already made
    varying over the union) varies over."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "mat", None))


def sum_to_type_of(cotangent, primal):
    """A cotangent varying over axes its primal does not is summed over them (the transpose of the broadcast)."""
    extra = varying_axes(cotangent) - varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def lower_in_shard_map_for_cuda(fn, args, *, in_specs, out_specs, shards: int = 8, axis: str = "data") -> str:
    """StableHLO text of `fn` traced inside shard_map (check_vma) over `shards` abstract H200s on axis `axis` and
    lowered for CUDA, also on a machine without a GPU (interpret mode cannot run inside shard_map on the CPU, so
    this is how the CPU tests check the kernels' types there). The kernels must not be in interpret mode."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((shards,), (axis,), (jax.sharding.AxisType.Auto,), abstract_device=device)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    with jax.sharding.use_abstract_mesh(mesh):
        structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tuple(args))
        return f.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()

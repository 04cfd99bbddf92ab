"""The five collectives as shard_map programs over a `topology.Group`, and a numpy reference for each.

Each collective is written per device: x is this rank's input block (1-D), the op returns its output block.
For timing, the op runs `iters` times inside one jitted fori_loop (so small messages measure the collective, not
the host's launch cost); each iteration's input depends on the previous output through a cheap step (at most 1/n
of the buffer is copied) so XLA can neither hoist nor merge the collectives.
Broadcast uses the CollectiveBroadcast HLO (lax.pbroadcast), which jax lowers on GPUs only; on the CPU it falls
back to the equivalent masked all-reduce, good for checking values but not for its bandwidth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.systems.conventions import COLLECTIVE_NAMES, per_rank_buffers
from benchmarks.systems.topology import AXES, Group

ALL = P(AXES)  # one block per device, in mesh order


def native_broadcast() -> bool:
    return jax.default_backend() == "gpu"


def _op(name: str, axes: tuple[str, ...], n: int):
    """(op, next_input): op maps this rank's input block to its output block."""
    if name == "all_reduce":
        return (lambda x: lax.psum(x, axes)), (lambda x, y: y)
    if name == "reduce_scatter":
        return (lambda x: lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True),
                lambda x, y: lax.dynamic_update_slice(x, y, (0,)))
    if name == "all_gather":
        return (lambda x: lax.all_gather(x, axes, axis=0, tiled=True),
                lambda x, y: y[: x.shape[0]])
    if name == "all_to_all":
        return (lambda x: lax.all_to_all(x.reshape(n, -1), axes, 0, 0, tiled=True).reshape(-1)), (lambda x, y: y)
    if name == "broadcast":
        if native_broadcast():
            return (lambda x: lax.pbroadcast(x, axes, 0)), (lambda x, y: y)
        return (lambda x: lax.psum(jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x)), axes),
                lambda x, y: y)
    raise ValueError(f"unknown collective {name!r}; known: {COLLECTIVE_NAMES}")


def block_elems(name: str, n: int, size_bytes: int, itemsize: int) -> int:
    """Elements of each rank's input block for a collective of logical `size_bytes` (rounded down so every
    rank's share is a whole number of elements)."""
    per_rank_in, _ = per_rank_buffers(name, n, size_bytes)
    unit = n if name in ("reduce_scatter", "all_to_all") else 1
    return max(unit, per_rank_in // itemsize // unit * unit)


def logical_bytes(name: str, n: int, elems: int, itemsize: int) -> int:
    """Inverse of block_elems: the nccl-tests size of a collective whose input blocks have `elems` elements."""
    return elems * itemsize * (n if name == "all_gather" else 1)


def programs(group: Group, name: str):
    """(once, loop): jitted functions of the [devices, elems] input (loop also takes the iteration count)."""
    op, step = _op(name, group.axes, group.n)

    def once(x):
        return op(x[0])[None]

    def loop(x, iters):
        def body(_, v):
            return step(v, op(v))
        return lax.fori_loop(0, iters, body, x[0])[None]

    smap = functools.partial(jax.shard_map, mesh=group.mesh, check_vma=False)
    return (jax.jit(smap(once, in_specs=ALL, out_specs=ALL)),
            jax.jit(smap(loop, in_specs=(ALL, P()), out_specs=ALL)))


def make_input(group: Group, elems: int, dtype, values: np.ndarray | None = None) -> jax.Array:
    """[devices, elems] sharded one row per device; `values` (host array) or a fill that costs no host copy."""
    sharding = NamedSharding(group.mesh, ALL)
    shape = (group.mesh.size, elems)
    if values is not None:
        return jax.device_put(values.astype(dtype), sharding)
    return jax.jit(lambda: jnp.full(shape, 1e-3, dtype), out_shardings=sharding)()


# ---- numpy reference ------------------------------------------------------------------------------------------
def _grouped(x: np.ndarray, group: Group) -> tuple[np.ndarray, callable]:
    """x [devices, e] -> [groups, n, e] with ranks in the collective's order, and the inverse mapping."""
    shape = [group.mesh.shape[a] for a in AXES]
    cube = x.reshape(*shape, x.shape[-1])
    rank_dims = [AXES.index(a) for a in group.axes]
    other_dims = [d for d in range(3) if d not in rank_dims]
    order = other_dims + rank_dims + [3]
    moved = cube.transpose(order)
    g = moved.reshape(-1, group.n, x.shape[-1])

    def back(y: np.ndarray) -> np.ndarray:
        y = y.reshape(*moved.shape[:-1], y.shape[-1]).transpose(np.argsort(order))
        return y.reshape(-1, y.shape[-1])

    return g, back


def reference(name: str, x: np.ndarray, group: Group) -> np.ndarray:
    """What every rank should hold after the collective, [devices, out_elems]."""
    g, back = _grouped(x, group)
    n = group.n
    if name == "all_reduce":
        out = np.broadcast_to(g.sum(1, keepdims=True), g.shape)
    elif name == "reduce_scatter":
        out = g.sum(1).reshape(g.shape[0], n, -1)
    elif name == "all_gather":
        out = np.broadcast_to(g.reshape(g.shape[0], 1, -1), (g.shape[0], n, g.shape[1] * g.shape[2]))
    elif name == "all_to_all":
        chunks = g.reshape(g.shape[0], n, n, -1)  # [group, sender, chunk, e/n]
        out = chunks.transpose(0, 2, 1, 3).reshape(g.shape)  # receiver r gets chunk r of every sender
    elif name == "broadcast":
        out = np.broadcast_to(g[:, :1], g.shape)
    else:
        raise ValueError(f"unknown collective {name!r}")
    return back(np.ascontiguousarray(out))


def check(group: Group, name: str, elems: int = 64) -> float:
    """Runs the collective once on distinct small integers and returns the max abs error against `reference`."""
    elems = max(group.n, elems // group.n * group.n)
    x = np.arange(group.mesh.size * elems, dtype=np.float32).reshape(group.mesh.size, elems) % 97
    once, _ = programs(group, name)
    got = np.asarray(once(make_input(group, elems, jnp.float32, x)))
    want = reference(name, x, group)
    if got.shape != want.shape:
        raise AssertionError(f"{name} on {group.label}: shape {got.shape} != expected {want.shape}")
    return float(np.abs(got - want).max())

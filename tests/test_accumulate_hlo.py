"""The compiled accumulation step copies no optimizer-state-sized buffer on a microbatch (optim/accumulate.py):
values passed unchanged through the lax.cond must alias in place, not be copied into its outputs. On one device
and under ZeRO-1 on 8 emulated devices (tests/conftest.py)."""

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer
from zaya_jax.parallel.hlo_comm import ELEMENT_BYTES
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.parallel.sharding import state_shardings, zero1

COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(%([\w.-]+)\)")


def data_copy_bytes(hlo_text: str) -> int:
    """Bytes written by the `copy` instructions of an optimized HLO module (every computation, branches included)
    that copy data; copies of a broadcast constant (XLA shares one zero-filled buffer between the untaken branch's
    zero updates, then copies it per output) are zero-fills the updates need anyway."""
    total = 0
    for dtype, dims, operand in COPY.findall(hlo_text):
        if "broadcast" in operand or operand.startswith("constant"):
            continue
        if dtype not in ELEMENT_BYTES:
            raise ValueError(f"copy of an HLO element type this count does not know: {dtype}")
        total += math.prod(int(d) for d in dims.split(",") if d) * ELEMENT_BYTES[dtype]
    return total


def compiled_accumulation_step(mesh=None) -> str:
    """Optimized HLO of the trainer's use of the optimizer (update, apply, state donated) with accumulation over 4
    microbatches; with a mesh, through ZeRO-1 (state sharded over it, parallel/sharding.py)."""
    # Square matrices: Muon transposes none of them, so any large copy is a pass-through of state.
    params = {"q_proj": {"weight": jnp.zeros((8, 128, 128))}, "o_proj": {"weight": jnp.zeros((128, 128))},
              "norm": {"weight": jnp.zeros((128,))}}
    tx = build_optimizer(OptimizerConfig(accumulation_steps=4, muon_ns_dtype="float32"), log=None)
    tx = tx if mesh is None else zero1(tx, mesh)

    def step(state, grads):
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    if mesh is None:
        return jax.jit(step, donate_argnums=0).lower(state, params).compile().as_text()
    shardings = state_shardings(state, mesh, zero1=True)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), params)
    return jax.jit(step, donate_argnums=0, out_shardings=shardings).lower(state, grads).compile().as_text()


@pytest.mark.parametrize("devices", [1, 8])
def test_a_donated_accumulation_step_copies_no_state_sized_buffer(devices):
    hlo = compiled_accumulation_step(None if devices == 1 else make_mesh(data=devices))
    # the smallest state buffer one device holds: its share of the fp32 accumulator (or of one moment)
    smallest_state_buffer = (8 * 128 * 128 + 128 * 128 + 128) * 4 // devices
    assert "conditional(" in hlo  # the inner update is still skipped on the other microbatches
    assert data_copy_bytes(hlo) < 0.1 * smallest_state_buffer, [line for line in hlo.splitlines() if " copy(" in line]

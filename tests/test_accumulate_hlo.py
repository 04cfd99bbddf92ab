"""The compiled accumulation step copies no optimizer-state-sized buffer on a microbatch (optim/accumulate.py):
values passed unchanged through the lax.cond must alias in place, not be copied into its outputs."""

import re

import jax
import jax.numpy as jnp
import optax

from zaya_jax.optim.optimizer import OptimizerConfig, build_optimizer

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(%([\w.-]+)\)")


def data_copy_bytes(hlo_text: str) -> int:
    """Bytes written by the `copy` instructions of an optimized HLO module (every computation, branches included)
    that copy data; copies of a broadcast constant (XLA shares one zero-filled buffer between the untaken branch's
    zero updates, then copies it per output) are zero-fills the updates need anyway."""
    total = 0
    for dtype, dims, operand in COPY.findall(hlo_text):
        if "broadcast" in operand or operand.startswith("constant"):
            continue
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * DTYPE_BYTES[dtype]
    return total


def test_a_donated_accumulation_step_copies_no_state_sized_buffer():
    # Square matrices: Muon transposes none of them, so any large copy is a pass-through of state.
    params = {"q_proj": {"weight": jnp.zeros((128, 128))}, "o_proj": {"weight": jnp.zeros((128, 128))},
              "norm": {"weight": jnp.zeros((128,))}}
    tx = build_optimizer(OptimizerConfig(accumulation_steps=4, muon_ns_dtype="float32"), log=None)

    def step(params, opt_state, grads):  # as the trainer: update, apply, state donated
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), params).compile().as_text()
    smallest_state_buffer = sum(x.size * 4 for x in jax.tree.leaves(params))  # the fp32 accumulator, one moment
    assert "conditional(" in hlo  # the inner update is still skipped on the other microbatches
    assert data_copy_bytes(hlo) < 0.1 * smallest_state_buffer, hlo

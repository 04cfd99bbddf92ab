"""The relaxed-ordering atomic add of the Pallas kernels: interpret-mode sums, and the memory semantic it lowers to."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _relaxed_atomic


def _accumulate(x, out, interpret: bool):
    """Every program of a grid of 4 adds its own x row-block into the same out block."""
    def kernel(x_ref, _, o_ref):
        _relaxed_atomic.relaxed_atomic_add(o_ref, (slice(None), slice(None)), x_ref[...])
    return pl.pallas_call(kernel, grid=(4,),
                          in_specs=[pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0)),
                                    pl.BlockSpec((16, 128), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((16, 128), lambda i: (0, 0)),
                          out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={1: 0},
                          interpret=interpret, debug=not interpret)(x, out)


def test_adds_of_every_program_accumulate():
    assert _relaxed_atomic.available()
    x = jax.random.normal(jax.random.key(0), (4, 16, 128))
    out = jax.random.normal(jax.random.key(1), (16, 128))
    got = _accumulate(x, out, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out + x.sum(0)), rtol=1e-6, atol=1e-6)


def test_lowers_to_a_relaxed_atomic_for_cuda():
    """The Triton module (printed by pallas_call's debug flag) holds a relaxed fadd, not plgpu's acq_rel one."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("d",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), jax.sharding.use_abstract_mesh(mesh):
        x, out = jax.ShapeDtypeStruct((4, 16, 128), jnp.float32), jax.ShapeDtypeStruct((16, 128), jnp.float32)
        jax.jit(lambda x, o: _accumulate(x, o, interpret=False)).trace(x, out).lower(lowering_platforms=("cuda",))
    atomics = [line for line in printed.getvalue().splitlines() if "tt.atomic_rmw" in line]
    assert len(atomics) == 1 and "fadd, relaxed, gpu" in atomics[0], atomics

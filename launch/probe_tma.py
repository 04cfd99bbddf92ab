"""Can a Pallas (Triton lowering) kernel add tiles into global memory with the Hopper tensor memory accelerator's
bulk reduce-add, the way FlashAttention-3 and cuDNN accumulate dq? `python -m launch.probe_tma --case C [--out F]`
on a CUDA GPU, one case per process (a kernel fault poisons the process).

Each of 1024 programs adds 64 fp32 tiles [64, 128] into an 8192 x 128 accumulator (programs overlap on rows, as
the fused attention backward's key blocks do on dq). Cases:
- `atomic`: per-element relaxed atomics (pallas_kernels/_relaxed_atomic.py), the baseline;
- `descriptor`: `tt.make_tensor_descriptor` + `tt.descriptor_reduce add` from a probe primitive's Triton lowering.
  Triton builds device-side descriptors in a global scratch buffer, which XLA's Triton custom-call emitter replaces
  with a null pointer: the kernel faults (CUDA_ERROR_ILLEGAL_ADDRESS);
- `own_slots`: each program builds its descriptor in its own slot of a buffer passed in, with the TritonNvidiaGPU
  ops Triton's own lowering emits, created by name (jax's bindings expose only the `tt` dialect): XLA rejects the
  module ("dialect 'ttng' is unknown").
On jax 0.11.2 only `atomic` runs (benchmarks/attention_tma_probe_h200.json).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

PROGRAMS, STEPS, ROWS, R, D = 1024, 64, 8192, 64, 128
ADDS = PROGRAMS * STEPS * R * D  # fp32 adds per call


def _primitive(case: str):
    """tile_add(desc_ref, acc_ref, row, val): acc[row:row + R, :] += val, lowered the `case` way."""
    from jax._src import core, state
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt
    from jax._src.pallas.triton import lowering as low

    prim = core.Primitive(f"probe_tile_add_{case}")
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(lambda *avals: ([], {state.WriteEffect(1)}))
    i32 = low._i32_constant

    @low.register_lowering(prim)
    def _lower(ctx, desc_ptr, acc_ptr, row, val):
        n_rows, n_cols = ctx.block_infos[1].full_shape_dtype.shape
        desc_type = ir.Type.parse(f"!tt.tensordesc<{R}x{D}xf32>")
        if case == "descriptor":
            desc = tt.make_tensor_descriptor(desc_type, acc_ptr, [i32(n_rows), i32(n_cols)],
                                             [low._i64_constant(n_cols), low._i64_constant(1)])
        else:  # the program's 128-byte slot; swizzle and box of the default NVMMA layout of an fp32 [R, 128] tile
            ir.Context.current.allow_unregistered_dialects = True
            slot = tt.addptr(desc_ptr.type, desc_ptr, low._mul(tt.get_program_id(0), i32(128)))
            attr = lambda v: ir.IntegerAttr.get(ir.IntegerType.get_signless(32), v)  # noqa: E731
            ir.Operation.create("ttng.tensormap_create", results=[], operands=[
                slot, acc_ptr, i32(32), i32(R), i32(n_cols), i32(n_rows), low._i64_constant(n_cols * 4), i32(1),
                i32(1)], attributes={"elem_type": attr(7), "interleave_layout": attr(0), "swizzle_mode": attr(3),
                                     "fill_mode": attr(0),
                                     "operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, 1, 2, 2, 1, 2])})
            ir.Operation.create("ttng.tensormap_fenceproxy_acquire", results=[], operands=[slot])
            desc = ir.Operation.create("ttng.reinterpret_tensor_descriptor", results=[desc_type],
                                       operands=[slot]).result
        tt.descriptor_reduce(tt.DescriptorReduceKind.ADD, desc, low._ensure_ir_value(val, ctx.avals_in[3]),
                             [low._ir_cast(row, ir.IntegerType.get_signless(32), signed=False), i32(0)])
        return []
    return prim


def _adder(case: str):
    if case == "atomic":
        from pallas_kernels._relaxed_atomic import relaxed_atomic_add
    else:
        prim = _primitive(case)

    def kernel(x_ref, acc_in_ref, desc_ref, acc_ref):
        del acc_in_ref
        i = pl.program_id(0)

        def step(s, carry):
            tile = x_ref[pl.ds(pl.multiple_of(s * R, R), R), :] * (i + 1).astype(jnp.float32)
            start = pl.multiple_of(((i * 7 + s) % (ROWS // R)) * R, R)
            if case == "atomic":
                relaxed_atomic_add(acc_ref, (pl.ds(start, R), slice(None)), tile)
            else:
                prim.bind(desc_ref, acc_ref, start, tile)
            return carry
        jax.lax.fori_loop(0, STEPS, step, 0)

    n_desc = PROGRAMS * 128
    return jax.jit(lambda x, acc: pl.pallas_call(
        kernel, grid=(PROGRAMS,),
        in_specs=[pl.BlockSpec((STEPS * R, D), lambda i: (0, 0)), pl.BlockSpec((ROWS, D), lambda i: (0, 0)),
                  pl.BlockSpec((n_desc,), lambda i: (0,))],
        out_specs=pl.BlockSpec((ROWS, D), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((ROWS, D), jnp.float32), input_output_aliases={1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1), name=f"probe_{case}",
    )(x, acc, jnp.zeros((n_desc,), jnp.uint8)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("atomic", "descriptor", "own_slots"), required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pallas_kernels import _bench

    x = np.random.default_rng(0).standard_normal((STEPS * R, D)).astype(np.float32)
    want = np.zeros((ROWS, D))
    for i in range(PROGRAMS):
        for s in range(STEPS):
            start = ((i * 7 + s) % (ROWS // R)) * R
            want[start:start + R] += x[s * R:(s + 1) * R] * (i + 1)
    try:
        fn = _adder(args.case)
        zeros = jnp.zeros((ROWS, D), jnp.float32)
        err = float(np.abs(np.asarray(fn(jnp.asarray(x), zeros)) - want).max() / np.abs(want).max())
        t = _bench.time_call(fn, jnp.asarray(x), zeros)
        row = dict(rel_err=err, ms=t * 1e3, gadds_per_s=ADDS / t / 1e9)
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the probe's answer
        row = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
    print(args.case, row, flush=True)
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"tma_probe_{args.case}.json")
    with open(out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__, case=args.case,
                       adds=ADDS, **row), f, indent=1)


if __name__ == "__main__":
    main()

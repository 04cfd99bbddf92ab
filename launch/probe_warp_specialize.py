"""Can a Pallas (Triton lowering) kernel use Triton's Hopper warp specialization? `python -m
launch.probe_warp_specialize [--out FILE]` on a CUDA GPU.

Warp specialization (a producer warp group loading tiles, consumer groups on the matmuls and softmax) is what
FA3 and cuDNN use to overlap attention's softmax with its matmuls. XLA's Triton pipeline for Hopper runs Triton's
NVGPU warp-specialization pass on loops that carry `tt.warp_specialize` (with 4 warps and >= 2 stages); Pallas
has no way to ask for it, so this probe wraps jax's `lower_jaxpr_to_triton_module` to set the attribute on every
`scf.for` of a kernel whose name ends in `_ws`, and times a plain 4096^3 bf16 matmul loop without and with it,
each in its own process (a failed compile can abort the process). On jax 0.11.2 the tagged kernel aborts in XLA
with "unsupported load type for producer commit": the producer partition needs TMA descriptor loads, which the
Pallas Triton lowering does not emit (benchmarks/warp_specialize_probe_h200.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

N, BM, BN, BK = 4096, 128, 128, 64


def _tag_ws_loops():
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering

    original = lowering.lower_jaxpr_to_triton_module

    def lower(jaxpr, *args, **kwargs):
        result = original(jaxpr, *args, **kwargs)
        if str(getattr(jaxpr.debug_info, "func_name", "")).endswith("_ws"):
            loops = []

            def visit(op):
                if op.name == "scf.for":
                    loops.append(op)
                return ir.WalkResult.ADVANCE

            result.module.operation.walk(visit)
            with result.module.context:
                for op in loops:
                    op.attributes["tt.warp_specialize"] = ir.UnitAttr.get()
        return result

    lowering.lower_jaxpr_to_triton_module = lower


def _run_case(name: str, stages: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from pallas_kernels import _bench

    _tag_ws_loops()

    def kernel(a_ref, b_ref, o_ref):
        def step(j, acc):
            s = pl.multiple_of(j * BK, BK)
            return acc + plgpu.dot(a_ref[:, pl.ds(s, BK)], b_ref[pl.ds(s, BK), :])
        o_ref[...] = jax.lax.fori_loop(0, N // BK, step, jnp.zeros((BM, BN), jnp.float32)).astype(o_ref.dtype)

    fn = jax.jit(pl.pallas_call(
        kernel, grid=(N // BM, N // BN),
        in_specs=[pl.BlockSpec((BM, N), lambda i, j: (i, 0)), pl.BlockSpec((N, BN), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((BM, BN), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((N, N), jnp.bfloat16),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=stages), name=name))
    a = jax.random.normal(jax.random.key(0), (N, N), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (N, N), jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    err = float(jnp.linalg.norm(fn(a, b).astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    return {"tflops": 2 * N ** 3 / _bench.time_call(fn, a, b) / 1e12, "rel_err": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "warp_specialize_probe.json"))
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = ap.parse_args()
    if args.case:
        name, stages = args.case.rsplit(":", 1)
        print(json.dumps(_run_case(name, int(stages))))
        return
    import jax
    if jax.default_backend() != "gpu":
        raise SystemExit("probe_warp_specialize: needs a CUDA GPU (Triton's Hopper pipeline)")
    report = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "matmul": f"{N}^3 bf16",
              "tiles": [BM, BN, BK], "num_warps": 4, "cases": {}}
    for case in ("mm:3", "mm_ws:3", "mm_ws:2"):
        p = subprocess.run([sys.executable, "-m", "launch.probe_warp_specialize", "--case", case],
                           capture_output=True, text=True, timeout=300)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and "Warning" not in ln]
        row = {"returncode": p.returncode}
        try:
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            row["error"] = next((ln for ln in lines if "Error" in ln), lines[-1] if lines else "")[:500]
        report["cases"][case] = row
        print(case, row, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

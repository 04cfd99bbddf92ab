"""Time of one balancing solve (routing_stats.balancing_correction) on [8192, 16] scores, the bench preset's
microbatch, at the library's constants: the XLA rounds (a sort each) against the Pallas rounds (one launch each,
pallas_kernels/balancing_solve.py) at its defaults and at other token chunks and warp counts; same
inputs, one process; per step = 16 microbatches x 8 layers. Medians of 7 repeats of 50 calls. --baseline FILE (may
repeat) times other versions of the kernel module in the same run (`git show REV:pallas_kernels/balancing_solve.py`).
Then equal shares (model/equal_shares.py) on the scores plus the solve's correction, as the train step runs it, with
the hand-on's cutoffs by a sort and by the Pallas search, twice each, interleaved, with the kernel time from a profiler
trace, per kernel (--equal-shares-only: that alone). The bf16 GEMM ceiling is
printed first (the machine's state in this run).

python -m benchmarks.bench_routing_solve [--out FILE.json] [--baseline FILE ...] [--equal-shares-only]"""

import argparse
import collections
import contextlib
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.bench import gemm_ceiling_tflops
from benchmarks.systems import profile_trace
from benchmarks.systems.timing import seconds_per_call
from pallas_kernels import balancing_solve as kernel
from zaya_jax.model import routing_stats as rs
from zaya_jax.model.equal_shares import equal_shares

N, E, CALLS_PER_STEP = 8192, 16, 16 * 8


@contextlib.contextmanager
def kernel_module(path):
    """The solve traced with the kernel module at `path` in place of pallas_kernels.balancing_solve."""
    if path is None:
        yield
        return
    spec = importlib.util.spec_from_file_location("pallas_kernels.balancing_solve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["pallas_kernels.balancing_solve"] = module
    try:
        yield
    finally:
        sys.modules["pallas_kernels.balancing_solve"] = kernel


def time_solve(impl, chunk=None, warps=None, module=None):
    kernel.CHUNK = chunk or default_chunk
    default_warps = kernel._warps
    if warps:
        kernel._warps = lambda n: warps
    x = jax.random.uniform(jax.random.key(0), (N, E)) * 1e-3
    f = jax.jit(lambda s: rs.balancing_correction(s, jnp.ones(N, bool), impl))
    with kernel_module(module):
        delta = f(x)
    kernel._warps = default_warps
    kernel.CHUNK = default_chunk
    return seconds_per_call(f, x, reps=7, calls=50, warmup=0) * 1e6, np.asarray(delta)


def time_equal_shares(impl: str):
    """After the solve: equal shares on the scores plus its correction (the selection's own imbalance), the hand-on's
    cutoffs by a sort ('xla') or by the Pallas search ('pallas')."""
    x = jax.random.uniform(jax.random.key(0), (N, E)) * 1e-3
    valid = jnp.ones(N, bool)
    scores = x + rs.balancing_correction(x, valid, "xla")
    index = jnp.argmax(scores, -1).astype(jnp.int32)
    f = jax.jit(lambda s, i: equal_shares(s, i, valid, impl))
    moved = int(f(scores, index)[1].sum())
    us = seconds_per_call(f, scores, index, reps=7, calls=50, warmup=0) * 1e6
    return dict(impl=f"equal_shares_{impl}", us_per_call=round(us, 1), ms_per_step=round(us * CALLS_PER_STEP / 1e3, 2),
                moved_tokens=moved, device=device_time(f, scores, index))


def device_time(f, *args, calls: int = 5) -> dict:
    """From a profiler trace of `calls` back-to-back calls (device clocks: the host's dispatch, which can bound a
    wall time of such small work, is not in it): kernels and kernel time per call, the span from the first kernel's
    start to the last one's end per call, and the time per kernel."""
    ops = profile_trace.device_ops_of_calls(f, *args, calls=calls)
    per_op = collections.Counter()
    for e in ops:
        per_op[profile_trace.kernel_key(e)] += e.duration_ns / calls / 1e3
    span = (max(e.start_ns + e.duration_ns for e in ops) - ops[0].start_ns) / calls / 1e3 if ops else 0
    return dict(kernels_per_call=len(ops) / calls, kernel_us_per_call=round(sum(per_op.values()), 1),
                span_us_per_call=round(span, 1), us_per_op={k: round(v, 1) for k, v in per_op.most_common()})


default_chunk = kernel.CHUNK


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks.bench_routing_solve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows here (JSON)")
    ap.add_argument("--baseline", action="append", default=[], help="another version of "
                    "pallas_kernels/balancing_solve.py, timed interleaved with this one (may repeat)")
    ap.add_argument("--equal-shares-only", action="store_true", help="time equal shares alone")
    args = ap.parse_args(argv)
    ceiling = gemm_ceiling_tflops(1024 if jax.default_backend() == "cpu" else 8192)
    print(f"bf16 GEMM ceiling {ceiling:.0f} TFLOP/s", flush=True)
    baselines = args.baseline
    rows, reference = [], None
    variants = [("pallas", None, None, None)] + [("pallas", 2048, warps, None) for warps in (2, 4, 16)] + [
        ("pallas", 512, 4, None)]
    if baselines:  # interleaved with this version's default
        variants = [("pallas", None, None, b) for b in baselines + [None]] * 2 + variants[1:]
    solves = [("xla", None, None, None)] + variants + [("xla", None, None, None)]
    for impl, chunk, warps, module in [] if args.equal_shares_only else solves:
        try:
            us, delta = time_solve(impl, chunk, warps, module)
        except Exception as err:  # a variant Triton cannot compile (registers) is reported, not fatal
            rows.append(dict(impl=impl, chunk=chunk, warps=warps, error=str(err)[:300]))
            print(rows[-1], flush=True)
            continue
        reference = delta if reference is None else reference
        rows.append(dict(impl=impl, chunk=chunk, warps=warps, module=module, rounds=rs.SOLVE_ROUNDS, tokens=rs.SOLVE_TOKENS,
                         us_per_solve=round(us, 1), ms_per_step=round(us * CALLS_PER_STEP / 1e3, 2),
                         max_abs_diff_vs_xla=float(np.abs(delta - reference).max())))
        print(rows[-1], flush=True)
    xla = [r["us_per_solve"] for r in rows if r["impl"] == "xla"]
    for r in rows:
        if "us_per_solve" in r:
            r["xla_over_this"] = round(np.median(xla) / r["us_per_solve"], 3)
    for impl in ("xla", "pallas", "xla", "pallas"):
        rows.append(time_equal_shares(impl))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, shape=[N, E], gemm_ceiling_tflops=round(ceiling),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

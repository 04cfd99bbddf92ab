"""Kernel-level trace of attention forward + backward: `python -m launch.profile_attention [--shape 1x32768]`.

For each implementation (the Pallas table row for the shape, and cuDNN on NVIDIA) it traces `--calls` back-to-back
fwd+bwd calls of the same function `launch.bench_attention_bwd` times (8 q / 2 kv heads, d=128, causal, bf16) under
jax.profiler and prints, per call: every kernel's time (median over the calls), their sum, and the wall span from
the first kernel's start to the last one's end, so the time outside the named kernels (small XLA fusions, launch
gaps) shows next to the kernels. Writes the same as JSON (--out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import warnings

import jax

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from pallas_kernels import _bench as bench  # noqa: E402
from pallas_kernels import _platform  # noqa: E402
from zaya_jax.systems import profile_trace  # noqa: E402

H, KV, D = 8, 2, 128
TOP = 20  # kernels printed per implementation (the JSON has all)


def trace_calls(fn, args, calls: int) -> dict:
    """-> {kernels: {name: median ms per call}, kernel_ms, span_ms} over `calls` traced calls of a jitted fn."""
    jax.block_until_ready(fn(*args))  # compiled and warm
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        ops, _, _ = profile_trace.load(logdir)
    ops.sort(key=lambda e: e.start_ns)
    # Calls run back to back and launch the same kernels each: consecutive equal shares of the sorted kernels.
    if len(ops) % calls:
        raise RuntimeError(f"{len(ops)} traced kernels do not split into {calls} equal calls")
    n = len(ops) // calls
    per_call = [ops[i * n:(i + 1) * n] for i in range(calls)]
    times = collections.defaultdict(list)
    for events in per_call:
        seen = collections.Counter()
        for e in events:  # a kernel launched twice in one call (e.g. two fusions of one name) gets numbered
            seen[e.name] += 1
            key = e.name if seen[e.name] == 1 else f"{e.name}#{seen[e.name]}"
            times[key].append(e.duration_ns / 1e6)
    kernels = {k: statistics.median(v) for k, v in times.items()}
    sums = [sum(e.duration_ns for e in ev) / 1e6 for ev in per_call]
    spans = [(max(e.start_ns + e.duration_ns for e in ev) - ev[0].start_ns) / 1e6 for ev in per_call]
    return dict(kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1])), kernel_ms=statistics.median(sums),
                span_ms=statistics.median(spans), calls=len(per_call))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1x32768", help="BxT")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_profile.json"))
    args = ap.parse_args()
    try:
        B, T = (int(x) for x in args.shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shape: expected BxT such as 1x32768, got {args.shape!r}") from None
    q, k, v, do = bench._attention_problem(B, T, H, KV, D)
    impls = ["pallas"] + (["cudnn"] if _platform.vendor() == "cuda" else [])
    report = dict(device=bench.device_summary(), B=B, T=T, H=H, KV=KV, d=D,
                  table=repr(_platform.attention_blocks(D, T)))
    for impl in impls:
        _, fwd_bwd = bench._attention_fns(impl, _platform.attention_blocks(D, T))
        row = trace_calls(fwd_bwd, (q, k, v, do), args.calls)
        report[impl] = row
        print(f"{impl}: span {row['span_ms']:.3f} ms per call, kernels {row['kernel_ms']:.3f} ms "
              f"(outside them {row['span_ms'] - row['kernel_ms']:.3f})", flush=True)
        listed = list(row["kernels"].items())
        for name, ms in listed[:TOP]:
            print(f"  {ms:8.3f}  {name[:110]}", flush=True)
        if len(listed) > TOP:
            print(f"  {sum(ms for _, ms in listed[TOP:]):8.3f}  ({len(listed) - TOP} more)", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

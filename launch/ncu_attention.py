"""Hardware counters of the attention kernels next to cuDNN's, through Nsight Compute (where `ncu` reads them).

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -o /tmp/attn \\
        -k 'regex:cca_attention_(fwd_bound|dq|dkv|bwd_fused|dkv_tiles|dq_tiles)|sdpa' -c 8 \\
        --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \\
        --section InstructionStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python -m launch.ncu_attention once --shape 1x16384 --impls split,atomic_q64h1,cudnn
    ncu --import /tmp/attn.ncu-rep --page raw --csv > raw.csv
    python -m launch.ncu_attention summarize raw.csv --out benchmarks/attention_ncu_h200.json

Executed instructions by SASS opcode (which instructions a kernel spends its issue slots on, e.g. the denormal
fix-ups around MUFU.EX2 without flush-to-zero): profile with `--section SourceCounters` instead, then

    ncu --import /tmp/attn.ncu-rep --page source --print-source sass --csv > sass.csv
    python -m launch.ncu_attention sass sass.csv --out benchmarks/attention_sass_h200.json

`once` makes one forward + backward call per implementation (8 q / 2 kv heads, d=128, causal, bf16): `cudnn` jax's
cuDNN attention, or any variant of `launch.bench_attention_bwd` (`split` the table's row for the shape,
`atomic_q64h1` the fused backward with dq by atomic adds, ...). Preallocation off: ncu saves and restores device memory around each replay
pass, all of a preallocated pool otherwise. `summarize` keeps, per profiled kernel, the figures that say what limits
it: time, tensor pipe activity, issue slots, registers, shared memory, spilling instructions, L2 atomic activity,
and the stall reasons per issued instruction.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import sys
import warnings

# summary key -> ncu raw metric
METRICS = {
    "ms": "gpu__time_duration.sum",
    "tensor_active_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
    "instructions": "smsp__inst_executed.sum",
    "registers_per_thread": "launch__registers_per_thread",
    "shared_kb_per_block": "launch__shared_mem_per_block",
    "spill_instructions": "sass__inst_executed_register_spilling",
    "l2_atomic_active_pct": "lts__d_atomic_input_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "xu_pipe_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "lsu_pipe_pct": "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
}
TO_MS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(rows: list[list[str]]) -> list[dict]:
    """ncu's raw CSV page (a header row, a units row, one row per kernel) -> one dict per kernel."""
    if len(rows) < 3 or "Kernel Name" not in rows[0]:
        raise SystemExit("summarize: expected ncu's '--page raw --csv' output (a 'Kernel Name' column, a units row)")
    head = rows[0]
    col = {name: i for i, name in enumerate(head)}
    out = []
    for row in rows[2:]:
        entry = {"kernel": row[col["Kernel Name"]]}
        for key, metric in METRICS.items():
            if metric in col:
                entry[key] = _number(row[col[metric]])
        if entry.get("ms") is not None:
            entry["ms"] *= TO_MS.get(rows[1][col[METRICS["ms"]]], 1.0)
        stalls = {name[len(STALL_PREFIX):-len(STALL_SUFFIX)]: _number(row[i]) for name, i in col.items()
                  if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX)}
        entry["stalls_per_issue"] = dict(sorted(((k, v) for k, v in stalls.items() if v), key=lambda kv: -kv[1]))
        out.append(entry)
    return out


def _opcode(source: str) -> str:
    """'@!P0 FMUL.FTZ R3, R3, 0.5 ;' -> 'FMUL.FTZ' (the guard predicate dropped)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].rstrip(";") if words else ""


def sass_mix(rows: list[list[str]], top: int = 24) -> dict:
    """ncu's source page as CSV (per kernel: a 'Kernel Name' row, a header row starting 'Address', one row per SASS
    instruction) -> per kernel: executed warp instructions in all, and the `top` opcodes by executed count, with
    the warp-stall samples taken at each."""
    executed, stalls, name, col = {}, {}, None, None
    for row in rows:
        if len(row) >= 2 and row[0] == "Kernel Name":
            name, col = row[1], None
            executed.setdefault(name, collections.Counter())
            stalls.setdefault(name, collections.Counter())
        elif row and row[0] == "Address":
            col = {h: i for i, h in enumerate(row)}
            stall_col = col.get("Warp Stall Sampling (All Samples)")
        elif name is not None and col is not None and len(row) == len(col):
            op = _opcode(row[col["Source"]])
            executed[name][op] += _number(row[col["Instructions Executed"]]) or 0
            if stall_col is not None:
                stalls[name][op] += _number(row[stall_col]) or 0
    if not executed:
        raise SystemExit("sass: expected ncu's '--page source --print-source sass --csv' output ('Kernel Name' rows)")
    return {kernel: dict(warp_instructions=sum(counts.values()),
                         top_opcodes={op: int(n) for op, n in counts.most_common(top)},
                         stall_samples={op: int(n) for op, n in stalls[kernel].most_common(12) if n})
            for kernel, counts in executed.items()}


def once(shape: str, impls: list[str]):
    """One fwd+bwd per implementation: 'cudnn' or a variant of launch.bench_attention_bwd (its problem and shapes)."""
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)
    import jax

    from launch.bench_attention_bwd import D, H, KV, VARIANTS, _parse_shapes
    from pallas_kernels import _bench as bench
    from pallas_kernels import _platform
    bad = [i for i in impls if i not in VARIANTS and i != "cudnn"]
    if bad or not impls:
        raise SystemExit(f"--impls: unknown {bad or impls}; expected 'cudnn' or variants of launch.bench_attention_bwd")
    shapes = _parse_shapes(shape)
    if len(shapes) != 1:
        raise SystemExit(f"--shape: one BxT, got {shape!r}")
    (B, T), = shapes
    q, k, v, do = bench._attention_problem(B, T, H, KV, D)
    table = _platform.attention_blocks(D, T)
    for impl in impls:
        if impl == "cudnn":
            _, fwd_bwd = bench._attention_fns("cudnn", None)
        else:
            _, fwd_bwd = bench._attention_fns("pallas", dataclasses.replace(table, **VARIANTS[impl]))
        jax.block_until_ready(fwd_bwd(q, k, v, do))
        print(f"{impl}: one fwd+bwd at B={B} T={T}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("once", help="one fwd+bwd call per implementation (run it under ncu)")
    a.add_argument("--shape", default="1x16384", help="BxT")
    a.add_argument("--impls", default="split,atomic_q64h1,cudnn",
                   help="'cudnn' and variants of launch.bench_attention_bwd ('split': the table's row)")
    for cmd, text in (("summarize", "ncu --page raw --csv output -> JSON"),
                      ("sass", "ncu --page source --print-source sass --csv output -> executed opcodes, JSON")):
        s = sub.add_parser(cmd, help=text)
        s.add_argument("csv")
        s.add_argument("--out", default=None)
        s.add_argument("--shape", default="1x16384", help="BxT of the profiled run (recorded in the JSON)")
    args = ap.parse_args()
    if args.cmd == "once":
        once(args.shape, [i for i in args.impls.split(",") if i])
        return
    try:
        with open(args.csv, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise SystemExit(f"{args.cmd}: cannot read {args.csv}: {e}") from None
    kernels = summarize(rows) if args.cmd == "summarize" else sass_mix(rows)
    paragraphs = __doc__.split("\n\n")  # the profiling commands of each summary, as the docstring gives them
    command = paragraphs[1] if args.cmd == "summarize" else "\n".join(paragraphs[2:4])
    text = json.dumps(dict(shape=args.shape, heads="8 q / 2 kv, d=128, causal, bf16", command=command,
                           kernels=kernels), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()

"""Where a greedy decode step's time goes: the decode loop of `generate_padded` under jax.profiler, its device
kernels grouped by HLO op and by the model source line that emitted them (the innermost zaya_jax frames of the
optimized HLO, which XLA dumps during the run), as total time per generated token and count per token, against the
wall time per token (which includes the prefill).

python -m benchmarks.profile_decode [--preset zaya1_8b] [--batch 1] [--prompt 512] [--new-tokens 64]
                                    [--kernels auto|xla] [--out FILE.json]"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile
import time

import jax
import numpy as np

from benchmarks.bench_inference import init_model
from benchmarks.systems import profile_trace
from benchmarks.training.bench_profile import hlo_instructions, hlo_sources
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.generate import generate_padded


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = parse_args(ap)
    dump = dump_optimized_hlo()
    model = init_model(args.preset)
    decoder = Decoder(model, kernels=args.kernels)
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (args.batch, args.prompt)).astype(np.int32)
    profile(args, dump, lambda: generate_padded(decoder, ids, max_new_tokens=args.new_tokens), args.new_tokens,
            "token", batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens)


def parse_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The options every inference profile takes, added to `ap`, parsed."""
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla"])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def profile(args, dump: str, fn, units: int, unit: str, **fields):
    """Compiles fn (one call), times three calls, traces a fourth, prints and writes (--out) the report: `fields`,
    the median wall time per `unit` (fn does `units` of them) and kernel_tables."""
    def run():
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - start

    run()
    wall = float(np.median([run() for _ in range(3)]))
    report = dict(preset=args.preset, kernels=args.kernels, device=jax.devices()[0].device_kind, **fields,
                  wall_s_median=wall, **{f"wall_ms_per_{unit}": wall * 1e3 / units},
                  **kernel_tables(run, dump, units, unit, args.top))
    print(json.dumps(report, indent=1))
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


def dump_optimized_hlo() -> str:
    """A folder into which XLA writes every compiled module as text (call before the backend starts: XLA reads its
    flags then)."""
    dump = tempfile.mkdtemp(prefix="profile_hlo_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    return dump


NO_FRAME = "(no project frame)"


def kernel_tables(run, dump: str, units: int, unit: str, top: int) -> dict:
    """Traces one run(); its kernels' time and count per `unit` (run() does `units` of them) in all, by HLO op and
    by the model source line that emitted them (the modules XLA wrote to `dump`)."""
    logdir = tempfile.mkdtemp(prefix="profile_trace_")
    with jax.profiler.trace(logdir):
        run()
    ops, _, lines = profile_trace.load(logdir)
    sources = module_sources(dump)
    # an event whose program is not among the dumped modules (or whose name its module lacks) is looked up in all
    # of them, the largest module's names taking precedence
    anywhere = {}
    for names in sorted(sources.values(), key=len):
        anywhere.update((k, v) for k, v in names.items() if v != NO_FRAME)
    known = set().union(*sources.values())
    per_op, per_source = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    unmatched = collections.Counter()
    for e in ops:
        key = profile_trace.kernel_key(e)
        name = kernel_name(key)
        own = sources.get(e.program_id, {}).get(name)
        source = own if own not in (None, NO_FRAME) else anywhere.get(name)
        if source is None:
            if name not in known:
                unmatched[key] += e.duration_ns
            source = NO_FRAME
        for table, k in ((per_op, key), (per_source, source)):
            table[k][0] += e.duration_ns
            table[k][1] += 1

    def rows(table, name):
        return [{name: k, f"ms_per_{unit}": round(v[0] / 1e6 / units, 4), f"calls_per_{unit}": v[1] / units}
                for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]]

    return {f"kernel_ms_per_{unit}": sum(v[0] for v in per_op.values()) / 1e6 / units,
            f"kernels_per_{unit}": len(ops) / units, "lines": lines, "idle": idle_time(ops, units, unit),
            "top_ops": rows(per_op, "op"),
            "top_sources": rows(per_source, "source"),
            # what the source table could not name, to debug its lookup: the programs of the trace against the
            # modules dumped, and the costliest unnamed kernels
            "source_lookup": dict(dumped_modules=len(sources), traced_programs=sorted({e.program_id for e in ops}
                                                                                       - {None})[:20],
                                  dumped_ids=sorted(sources)[:20], unnamed=[k for k, _ in unmatched.most_common(8)])}


def idle_time(ops, units: int, unit: str, top: int = 8) -> dict:
    """Where the GPU waited within the traced run: the span from the first kernel's start to the last one's end,
    the time in it when no kernel ran (gaps between kernels: launches the host did not issue ahead), and the largest
    gaps with the kernels on either side. A wall time above the span is host work before or after the kernels."""
    if not ops:
        return {}
    ops = sorted(ops, key=lambda e: e.start_ns)
    first, busy_end, idle, gaps = ops[0].start_ns, ops[0].start_ns + ops[0].duration_ns, 0.0, []
    before = ops[0]
    for e in ops[1:]:
        if e.start_ns > busy_end:
            idle += e.start_ns - busy_end
            gaps.append((e.start_ns - busy_end, before.name, e.name))
        if e.start_ns + e.duration_ns >= busy_end:
            busy_end, before = e.start_ns + e.duration_ns, e
    gaps.sort(reverse=True)
    return {f"span_ms_per_{unit}": (busy_end - first) / 1e6 / units, f"idle_in_span_ms_per_{unit}": idle / 1e6 / units,
            "largest_gaps": [dict(us=round(g / 1e3, 1), after=a, before=b) for g, a, b in gaps[:top]]}


def kernel_name(instruction: str) -> str:
    """An HLO instruction's name as XLA names its kernel (and the profiler some of its events)."""
    return instruction.replace(".", "_").replace("-", "_")


def module_sources(dump: str) -> dict[int, dict[str, str]]:
    """{module id: {instruction's kernel name: its source line}} from the optimized modules XLA dumped
    (module_<id>.*); an instruction no project line emitted (XLA's copies and relayouts of parameters) maps to
    NO_FRAME, so that only kernels missing from every module count as unnamed."""
    out = {}
    for path in glob.glob(os.path.join(dump, "module_*after_optimizations.txt")):
        text = open(path).read()
        names = dict.fromkeys(map(kernel_name, hlo_instructions(text)), NO_FRAME)
        names.update((kernel_name(k), v) for k, v in hlo_sources(text).items())
        out[int(os.path.basename(path).split(".")[0].removeprefix("module_"))] = names
    return out


if __name__ == "__main__":
    main()

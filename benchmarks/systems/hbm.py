"""HBM bandwidth over buffer sizes: read (a sum), write (a fill), copy (y = x * s), each through XLA and through
the Pallas kernels of hbm_pallas. Bytes count every input read once and every output written once; the headline
is the plateau of the copy curve (what STREAM calls Copy/Scale, the figure the paper quotes for MI300X)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.systems import hbm_pallas, plots
from benchmarks.systems.report import table, write_json
from benchmarks.systems.saturation import saturation_point
from benchmarks.systems.sizes import KIB, human_bytes, memory_cap, power_ladder
from benchmarks.systems.timing import calls_for, device_memory_bytes, seconds_per_call

OPS = ("read", "write", "copy")
IMPLS = ("xla", "pallas")
F32 = jnp.float32


def _program(impl: str, op: str, rows: int):
    """(jitted fn, its arguments, bytes moved per call) for a [rows, COLS] fp32 buffer."""
    cols = hbm_pallas.COLS
    n_bytes = rows * cols * 4
    x = jax.random.normal(jax.random.key(rows), (rows, cols), F32)
    if impl == "xla":
        if op == "read":
            return jax.jit(lambda x: jnp.sum(x)), (x,), n_bytes
        if op == "write":
            return jax.jit(lambda v: jnp.broadcast_to(v, (rows, cols))), (jnp.float32(1.5),), n_bytes
        return jax.jit(lambda x, s: x * s), (x, jnp.float32(1.5)), 2 * n_bytes
    if op == "read":
        partials = rows // hbm_pallas.block_rows(rows) * cols * 4
        return hbm_pallas.read, (x,), n_bytes + partials
    if op == "write":
        return (lambda v: hbm_pallas.write(v, rows)), (jnp.full((1, cols), 1.5, F32),), n_bytes
    return hbm_pallas.copy, (x,), 2 * n_bytes


def measure(impl: str, op: str, size_bytes: int, target_s: float = 0.01) -> dict:
    rows = max(1, size_bytes // (hbm_pallas.COLS * 4))
    fn, args, moved = _program(impl, op, rows)
    probe = seconds_per_call(fn, *args, reps=1, calls=1, warmup=1)
    t = seconds_per_call(fn, *args, reps=3, calls=calls_for(probe, target_s), warmup=0)
    return dict(impl=impl, op=op, size_bytes=rows * hbm_pallas.COLS * 4, seconds=t, bytes_moved=moved,
                bandwidth=moved / t)


def sweep(*, min_bytes: int = 64 * KIB, max_bytes: int | None = None, step: int = 2, impls=IMPLS, ops=OPS,
          target_s: float = 0.01, log=print) -> dict:
    device_bytes = device_memory_bytes()
    if max_bytes is None:
        max_bytes = 4 * (1 << 30) if device_bytes else 16 * (1 << 20)
    sizes = power_ladder(min_bytes, memory_cap(max_bytes, device_bytes, buffers=3.0), step)
    records = []
    for impl in impls:
        for op in ops:
            for size in sizes:
                records.append(measure(impl, op, size, target_s))
            log(f"  {impl:>6} {op:>5}: {human_bytes(records[-1]['size_bytes'])} "
                f"{records[-1]['bandwidth'] / 1e9:.1f} GB/s")
    summary = []
    for impl in impls:
        for op in ops:
            rows = [r for r in records if (r["impl"], r["op"]) == (impl, op)]
            sat = saturation_point([r["size_bytes"] for r in rows], [r["bandwidth"] for r in rows], 0.9)
            summary.append(dict(impl=impl, op=op, peak_bandwidth=max(r["bandwidth"] for r in rows),
                                plateau_bandwidth=sat.plateau, saturation_bytes=sat.x))
    copy = {s["impl"]: s["plateau_bandwidth"] for s in summary if s["op"] == "copy"}
    return dict(sizes=sizes, records=records, summary=summary, copy_bandwidth=copy)


def summary_table(result: dict) -> str:
    rows = [dict(s, peak=s["peak_bandwidth"] / 1e9, plateau=s["plateau_bandwidth"] / 1e9,
                 sat=human_bytes(s["saturation_bytes"]) if s["saturation_bytes"] else None)
            for s in result["summary"]]
    return table(rows, [("impl", "impl", ""), ("op", "op", ""), ("peak", "peak GB/s", ".1f"),
                        ("plateau", "plateau GB/s", ".1f"), ("sat", "90% at", "")])


def plot(result: dict, path: str) -> str:
    panels = []
    for op in OPS:
        series = []
        for impl in IMPLS:
            rows = [r for r in result["records"] if (r["impl"], r["op"]) == (impl, op)]
            if rows:
                series.append(dict(label=impl, x=[r["size_bytes"] for r in rows],
                                   y=[r["bandwidth"] / 1e9 for r in rows]))
        if series:
            panels.append(dict(title=op, series=series))
    return plots.line_panels(path, panels, xlabel="buffer size (bytes)", ylabel="GB/s", title="HBM bandwidth")


def run(out_dir: str, log=print, **kw) -> dict:
    result = sweep(log=log, **kw)
    write_json(f"{out_dir}/hbm.json", result)
    plots.try_plot(plot, result, f"{out_dir}/hbm.png", log)
    log(summary_table(result))
    return result

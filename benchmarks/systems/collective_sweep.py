"""The collective sweep: every collective over every device group and message size; latency, algorithm and bus
bandwidth, and the saturation point per collective, whose reduce-scatter value at the widest group is the
recommended gradient bucket (spec section 13: smallest size within ~5% of the plateau)."""

from __future__ import annotations

import jax.numpy as jnp

from benchmarks.systems import plots
from benchmarks.systems.collectives import block_elems, check, logical_bytes, make_input, native_broadcast, programs
from benchmarks.systems.conventions import COLLECTIVE_NAMES, algbw, busbw
from benchmarks.systems.report import table, write_json
from benchmarks.systems.saturation import fit_latency_bandwidth, saturation_point
from benchmarks.systems.sizes import KIB, human_bytes, memory_cap, power_ladder
from benchmarks.systems.timing import calls_for, device_memory_bytes, seconds_per_call
from benchmarks.systems.topology import Group, groups, layout

BUCKET_FRACTION = 0.95


def measure(group: Group, name: str, size_bytes: int, dtype=jnp.float32, target_s: float = 0.02) -> dict:
    itemsize = jnp.dtype(dtype).itemsize
    elems = block_elems(name, group.n, size_bytes, itemsize)
    size = logical_bytes(name, group.n, elems, itemsize)
    _, loop = programs(group, name)
    x = make_input(group, elems, dtype)
    probe = seconds_per_call(loop, x, 2, reps=1, calls=1, warmup=1) / 2
    iters = calls_for(probe, target_s)
    t = seconds_per_call(loop, x, iters, reps=3, calls=1, warmup=0) / iters
    return dict(scope=group.scope, n=group.n, collective=name, size_bytes=size, seconds=t,
                algbw=algbw(size, t), busbw=busbw(name, group.n, size, t))


def summarize(records: list[dict], fraction: float = BUCKET_FRACTION) -> list[dict]:
    out = []
    keys = sorted({(r["scope"], r["n"], r["collective"]) for r in records})
    for scope, n, name in keys:
        rows = sorted((r for r in records if (r["scope"], r["n"], r["collective"]) == (scope, n, name)),
                      key=lambda r: r["size_bytes"])
        sizes = [r["size_bytes"] for r in rows]
        sat = saturation_point(sizes, [r["busbw"] for r in rows], fraction)
        alpha, beta = fit_latency_bandwidth(sizes, [r["seconds"] for r in rows]) if len(rows) > 1 else (None, None)
        out.append(dict(scope=scope, n=n, collective=name, latency_s=rows[0]["seconds"],
                        peak_busbw=max(r["busbw"] for r in rows), saturation_bytes=sat.x,
                        plateau_busbw=sat.plateau, fit_latency_s=alpha, fit_bandwidth=beta))
    return out


def recommended_bucket(summary: list[dict]) -> dict | None:
    """Reduce-scatter (ZeRO-1's gradient collective; all-reduce if absent) saturation at the widest group,
    preferring groups that cross nodes."""
    for name in ("reduce_scatter", "all_reduce"):
        for scope in ("global", "rail", "node"):
            rows = [s for s in summary if s["collective"] == name and s["scope"] == scope and s["saturation_bytes"]]
            if rows:
                best = max(rows, key=lambda s: s["n"])
                return dict(bytes=best["saturation_bytes"], collective=name, scope=scope, n=best["n"],
                            plateau_busbw=best["plateau_busbw"])
    return None


def sweep(*, min_bytes: int = KIB, max_bytes: int | None = None, step: int = 2, names=COLLECTIVE_NAMES,
          scopes=("node", "rail", "global"), local_per_node: int | None = None, all_rails: bool = False,
          dtype=jnp.float32, target_s: float = 0.02, log=print) -> dict:
    grid = layout(local_per_node)
    device_bytes = device_memory_bytes()
    if max_bytes is None:
        max_bytes = 8 * (1 << 30) if device_bytes else 8 * (1 << 20)
    # largest per-rank footprint: all-gather holds its input, its output and the loop's copy
    cap = memory_cap(max_bytes, device_bytes, buffers=3.0)
    sizes = power_ladder(min_bytes, max(min_bytes, cap), step)
    chosen = [g for g in groups(grid, scopes, all_rails) if g.n >= 2]
    records, checks = [], []
    for g in chosen:
        for name in names:
            err = check(g, name)
            checks.append(dict(scope=g.scope, n=g.n, collective=name, max_abs_error=err))
            if err > 0:
                raise AssertionError(f"{name} on {g.label} returned wrong values (max error {err})")
            for size in sizes:
                records.append(measure(g, name, size, dtype, target_s))
            last = records[-1]
            log(f"  {g.label:>10} {name:>15}: {human_bytes(last['size_bytes'])} busbw "
                f"{last['busbw'] / 1e9:.2f} GB/s")
    summary = summarize(records)
    return dict(grid=list(grid.shape), sizes=sizes, dtype=jnp.dtype(dtype).name, records=records,
                summary=summary, checks=checks, bucket=recommended_bucket(summary),
                broadcast_impl="CollectiveBroadcast" if native_broadcast() else "masked all-reduce (no "
                "CollectiveBroadcast on this backend: values checked, bandwidth is an all-reduce's)",
                note=None if chosen else "fewer than 2 devices: no collective to measure")


def summary_table(result: dict) -> str:
    rows = [dict(s, latency_us=s["latency_s"] * 1e6, peak=s["peak_busbw"] / 1e9,
                 sat=human_bytes(s["saturation_bytes"]) if s["saturation_bytes"] else None)
            for s in result["summary"]]
    return table(rows, [("scope", "scope", ""), ("n", "n", ""), ("collective", "collective", ""),
                        ("latency_us", "lat us", ".1f"), ("peak", "busbw GB/s", ".2f"), ("sat", "saturates at", "")])


def plot(result: dict, path: str) -> str:
    panels = []
    for scope, n in sorted({(s["scope"], s["n"]) for s in result["summary"]}):
        series, marks = [], []
        for s in result["summary"]:
            if (s["scope"], s["n"]) != (scope, n):
                continue
            rows = sorted((r for r in result["records"]
                           if (r["scope"], r["n"], r["collective"]) == (scope, n, s["collective"])),
                          key=lambda r: r["size_bytes"])
            series.append(dict(label=s["collective"], x=[r["size_bytes"] for r in rows],
                               y=[r["busbw"] / 1e9 for r in rows]))
            if s["collective"] == "reduce_scatter" and s["saturation_bytes"]:
                marks.append(dict(x=s["saturation_bytes"], label="RS saturation"))
        panels.append(dict(title=f"{scope}, {n} devices", series=series, marks=marks))
    return plots.line_panels(path, panels, xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
                             title="collectives (nccl-tests bus bandwidth)")


def run(out_dir: str, log=print, **kw) -> dict:
    result = sweep(log=log, **kw)
    write_json(f"{out_dir}/collectives.json", result)
    if result["summary"]:
        plots.try_plot(plot, result, f"{out_dir}/collectives.png", log)
        log(summary_table(result))
        if result["bucket"]:
            b = result["bucket"]
            log(f"recommended gradient bucket: {human_bytes(b['bytes'])} ({b['collective']} over {b['scope']} "
                f"x{b['n']})")
    else:
        log(result["note"])
    return result

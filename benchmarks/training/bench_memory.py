"""Device memory for the training benchmark: XLA's compile-time memory analysis of a program, the allocator's live
figures, the checks that keep a variant from running out of memory mid-run, and one up-front reservation.

Why the reservation: with preallocation off (the HF process shares the GPU while both compile), JAX's BFC
allocator grows region by region and never returns a free region, so after a few variants the 40-65 GiB
temporaries of the 32k / large-batch steps found no region big enough although most memory was free (the H200
runs of benchmarks/results/train_h200.json). Once the HF process has exited, one allocation of everything left under the
limit makes one region that every later buffer is carved from (freed chunks coalesce inside a region).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GIB = 2 ** 30
HEADROOM = 0.04  # of the limit, kept free at run time for the batch, small outputs and allocator rounding
PLAN_HEADROOM = 0.08  # planning also leaves room for the regions the allocator took while compiling (autotuning)


def memory_of(compiled) -> dict:
    """XLA's memory analysis of a compiled program, with the peak it implies when its arguments are resident."""
    try:
        m = compiled.memory_analysis()
        out = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                               "alias_size_in_bytes", "temp_size_in_bytes")}
    except Exception as e:  # noqa: BLE001 - a backend without the analysis: no estimate, the variant still runs
        return {"error": repr(e)}
    out["peak_estimate_gib"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                - out["alias_size_in_bytes"] + out["temp_size_in_bytes"]) / GIB
    out["extra_gib"] = extra_gib(out)
    return out


def extra_gib(m: dict) -> float:
    """What a call allocates beyond its (resident) arguments: temporaries and outputs not aliased to donations."""
    return (m.get("temp_size_in_bytes", 0) + m.get("output_size_in_bytes", 0) - m.get("alias_size_in_bytes", 0)) / GIB


def device_memory() -> dict:
    """The allocator's figures in GiB (zeros where the backend reports none, e.g. the CPU)."""
    try:
        s = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        s = {}
    g = lambda k: s.get(k, 0) / GIB
    return {"peak_gib": g("peak_bytes_in_use"), "in_use_gib": g("bytes_in_use"), "limit_gib": g("bytes_limit"),
            "pool_gib": g("pool_bytes"), "largest_free_block_gib": g("largest_free_block_bytes")}


def memory_limit_gib(override: float | None) -> float | None:
    """The budget the searches plan against: --memory-limit-gib, else the allocator's limit, else unknown."""
    if override:
        return override
    return device_memory()["limit_gib"] or None


def fits_alone(m: dict, limit_gib: float | None) -> bool:
    """Planning check (before anything runs): the whole footprint, state included, within the limit less headroom.
    Unknown limit or no analysis: assume it fits (the CPU)."""
    if not limit_gib or "peak_estimate_gib" not in m:
        return True
    return m["peak_estimate_gib"] <= limit_gib * (1 - PLAN_HEADROOM)


def fits_now(m: dict, limit_override: float | None = None) -> tuple[bool, str]:
    """Run-time check, arguments already resident: the extra allocation within what is free, and the temporaries
    (one buffer) within one free block of the reserved region or what may still be reserved under the limit."""
    d = device_memory()
    limit = limit_override or d["limit_gib"]
    if not limit or "temp_size_in_bytes" not in m:
        return True, ""
    extra, temp = m["extra_gib"], m["temp_size_in_bytes"] / GIB
    free = limit - d["in_use_gib"]
    if extra > free - limit * HEADROOM:
        return False, f"needs {extra:.1f} GiB more, {free:.1f} GiB free of {limit:.1f}"
    # only where the allocator reports its largest free block (0 may mean "not tracked")
    one_block = max(d["largest_free_block_gib"], limit - d["pool_gib"])
    if d["largest_free_block_gib"] > 0 and temp > one_block:
        return False, f"temporaries {temp:.1f} GiB exceed the largest free block {one_block:.1f} GiB"
    return True, ""


def reserve_one_region(fraction: float = 0.98) -> float:
    """Allocate and free `fraction` of what the allocator may still reserve, as one buffer, so the BFC allocator
    holds it as one region (see the module docstring). Returns the GiB reserved (0 where there is no limit)."""
    d = device_memory()
    if not d["limit_gib"]:
        return 0.0
    room = (d["limit_gib"] - d["pool_gib"]) * fraction
    if room < 1:
        return 0.0
    cols = 2 ** 20
    rows = int(room * GIB) // cols
    buf = jax.jit(lambda: jnp.zeros((rows, cols), jnp.uint8))()
    buf.block_until_ready()
    buf.delete()
    return rows * cols / GIB

"""Every measurement in one run (`python -m benchmarks.characterize all`): the torch cross-check, HBM, GEMM,
attention crossover, collectives (with 2+ devices), the profiled step breakdown, the storage model; then a
hardware file built from what was measured (hardware.json, for `python -m benchmarks.size_model --hardware`) and the
advisor's answer for ZAYA1-base at 4k and 32k on it (advice.json). Each stage writes its JSON and PNG as soon as it
finishes, so a run cut short keeps what it had.

Sizes: the default ladders are chosen to finish in about four minutes on one H200 (most of it compilation);
`quick` shrinks everything for the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback

import jax

from zaya_jax.config import preset
from benchmarks.systems import (advisor, attention_sweep, breakdown, collective_sweep, crosscheck, gemm, hardware, hbm,
                              storage)
from benchmarks.systems.report import write_json
from benchmarks.systems.sizes import KIB, MIB

STAGES = ("crosscheck", "hbm", "gemm", "attention", "collectives", "breakdown", "storage", "advice")


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    model: str = "zaya1_8b"  # GEMM and attention shapes
    quick: bool = False  # tiny sizes (CPU smoke run)
    stages: tuple = STAGES
    breakdown: breakdown.BreakdownConfig = dataclasses.field(default_factory=breakdown.BreakdownConfig)
    local_per_node: int | None = None  # emulate nodes for the collectives (CPU)


def _quick_kwargs():
    return dict(
        hbm=dict(min_bytes=64 * KIB, max_bytes=256 * KIB, step=4, target_s=0.002),
        gemm=dict(m_min=64, m_max=256, m_step=4, square_min=64, square_max=256, target_s=0.002),
        attention=dict(tokens=256, min_len=64, max_len=256, target_s=0.002),
        collectives=dict(min_bytes=KIB, max_bytes=16 * KIB, step=4, target_s=0.002),
    )


def _full_kwargs():
    return dict(hbm=dict(step=4), gemm=dict(square_min=1024), attention=dict(),
                collectives=dict(max_bytes=4 * 1024 * MIB))


def run(sc: SuiteConfig, out_dir: str, log=print) -> dict:
    kw = _quick_kwargs() if sc.quick else _full_kwargs()
    cfg = preset(sc.model)
    if sc.quick:
        cfg = preset("tiny")
    done, errors, t_start = {}, {}, time.perf_counter()

    def stage(name, fn):
        """Runs one stage; a failure is logged and recorded, and the later stages still run (one GPU session
        should bring back everything that worked)."""
        if name not in sc.stages:
            return None
        t = time.perf_counter()
        log(f"== {name}")
        try:
            done[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported in errors.json, never swallowed silently
            done[name] = None
            errors[name] = f"{type(e).__name__}: {e}"
            log(f"   FAILED: {errors[name]}\n{traceback.format_exc(limit=6)}")
        log(f"   ({time.perf_counter() - t:.0f} s, {time.perf_counter() - t_start:.0f} s total)")
        return done[name]

    stage("crosscheck", lambda: crosscheck.run(out_dir, log=log) if not sc.quick else {"skipped": "quick run"})
    hbm_r = stage("hbm", lambda: hbm.run(out_dir, log=log, **kw["hbm"]))
    gemm_r = stage("gemm", lambda: gemm.run(cfg, out_dir, log=log, **kw["gemm"]))
    peak = gemm_r["best_tflops"] * 1e12 if gemm_r else None
    bw = hbm_r["copy_bandwidth"]["xla"] if hbm_r else None
    stage("attention", lambda: attention_sweep.run(cfg, out_dir, log=log, peak_flops=peak, hbm_bandwidth=bw,
                                                   **kw["attention"]))
    if jax.device_count() >= 2:
        stage("collectives", lambda: collective_sweep.run(out_dir, log=log, local_per_node=sc.local_per_node,
                                                          **kw["collectives"]))
    stage("breakdown", lambda: breakdown.run(sc.breakdown, out_dir, log=log))
    stage("storage", lambda: storage.run(storage.StorageCase(), out_dir, log=log))
    stage("advice", lambda: _advice(out_dir, log))
    if errors:
        write_json(f"{out_dir}/errors.json", errors)
    return done


def _advice(out_dir: str, log) -> dict:
    """The measured hardware file and the advisor's ZAYA1-base plan on it."""
    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    base = next((spec for key, spec in hardware.PRESETS.items() if key in kind), hardware.MI300X)
    sweeps = [f"{out_dir}/{n}.json" for n in ("hbm", "gemm", "collectives")]
    present = [p for p in sweeps if os.path.exists(p)]
    hw = hardware.from_sweeps(base, present) if present else base
    with open(f"{out_dir}/hardware.json", "w") as f:
        json.dump(hw.as_dict(), f, indent=1)
    plans = {}
    for seq_len, batch in ((4096, 2 ** 24), (32768, 30 * 2 ** 20)):
        rec = advisor.recommend(preset("zaya1_base"), hw, advisor.Target(seq_len, 1024, batch))
        plans[str(seq_len)] = rec
        log(f"-- ZAYA1-base at {seq_len} on 1024 x {hw.name}:\n{advisor.describe(rec)}")
    write_json(f"{out_dir}/advice.json", dict(hardware=hw.as_dict(), plans=plans))
    return plans


FIGURES = {"collectives": collective_sweep.plot, "hbm": hbm.plot, "gemm": gemm.plot, "attention": attention_sweep.plot,
           "breakdown": breakdown.plot, "storage": storage.plot}


def redraw(out_dir: str, log=print) -> list[str]:
    """Draws every figure again from the JSON files in out_dir (e.g. after a GPU run on a box without
    matplotlib)."""
    drawn = []
    for name, plot in FIGURES.items():
        path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            if name != "collectives" or result.get("summary"):
                drawn.append(plot(result, os.path.join(out_dir, f"{name}.png")))
    log("drew " + ", ".join(os.path.basename(p) for p in drawn))
    return drawn

"""Norm launch study in one run: the fused residual merge + RMSNorm forward, backward and forward+backward, for
the launch rows in the table now (`old`) and a set of candidates, next to copy bandwidth and XLA's fusion.

    python -m benchmarks.kernels.tune_norm --out norm.json [--budget-s 60] [--quick]

All timings are medians (benchmarks.kernels.bench.time_call). Bytes per element of the merge: forward 12 (read branch
bf16 + residual fp32, write h fp32 + y bf16), backward 18 (read branch, residual, dh fp32, dy bf16; write d_branch
bf16, d_residual fp32); the [rows] rstd and the per-program [D] weight-gradient partials are overhead, not counted
(the partials are `programs x 4 x D x 4` bytes written and read back: reported per backward row as partial_mb).
Copy bandwidth counts read + write. XLA's backward alone is not a separate program: it is reported as fwd+bwd - fwd.
Every candidate's outputs are compared with the table row's (max_rel_diff_vs_old: only the order of the fp32
weight-gradient sums differs), and the end-to-end rows with XLA's (max_rel_err_vs_xla).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings

import jax
import jax.numpy as jnp

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from benchmarks.kernels import bench
from pallas_kernels import platform
from pallas_kernels.platform import NormLaunch

ROWS, D = 16384, 2048
PASS_BYTES = bench.NORM_PASS_BYTES
N_PARTIALS = 4  # the merge backward's [D] partial sums per program
# A candidate whose outputs differ more than this from the table row's computes something else: never chosen.
MAX_REL_DIFF = 1e-4

# NormLaunch(rows per step, num_warps, programs per compute unit (0: one program per tile), num_stages, prefetch).
# Measured before on the H200 (benchmarks/norm_h200.json, now in git history: docs/experiments.md) and not
# repeated: streaming loads (evict_first; forward 0.81 vs 0.83 of copy, backward 0.66 vs 0.73), re-reading the
# [D] vectors per row, 2-4 rows per step, 4 warps, num_stages 2 (Triton does not pipeline these loads through
# shared memory: no dot in the loop).
# Registers per thread, from Triton 3.9 + ptxas for sm_90a on the CPU (XLA's own Triton may differ a little; an SM
# has 64K): backward at 8 warps 128 / 164 / 199 / 221 with prefetch 0 / 1 / 2 / 3 (so one program of 8 warps per
# SM unless prefetch is 0); at 16 warps 76 / 92 / 110 / 118 / 128 with prefetch 0-4 (one per SM). Forward at 8 warps
# 64 / 80 / 95 (prefetch 0 / 1 / 2), at 16 warps 50 / 56 (prefetch 1 / 2: two programs per SM).
# The backward candidates trade occupancy (prefetch 0: two 8-warp programs per SM) against rows in flight per
# program (prefetch 2-4 at one program per SM).
CANDIDATES = {  # the backward first: it is the pass short of the goal (--budget-s may cut the list)
    "bwd": [NormLaunch(1, 8, 1, 1, 1), NormLaunch(1, 8, 1, 1, 2), NormLaunch(1, 8, 1, 1, 3), NormLaunch(1, 8, 1, 1, 4),
            NormLaunch(1, 8, 2, 1, 2), NormLaunch(1, 8, 2, 1, 3), NormLaunch(1, 8, 2, 1, 0), NormLaunch(1, 8, 4, 1, 0),
            NormLaunch(1, 8, 6, 1, 0), NormLaunch(1, 16, 1, 1, 1), NormLaunch(1, 16, 1, 1, 2),
            NormLaunch(1, 16, 1, 1, 3), NormLaunch(1, 16, 1, 1, 4), NormLaunch(1, 16, 2, 1, 2),
            NormLaunch(1, 16, 2, 1, 4), NormLaunch(1, 16, 2, 1, 0), NormLaunch(1, 16, 4, 1, 0)],
    "fwd": [NormLaunch(1, 8, 6, 1, 2), NormLaunch(1, 8, 4, 1, 2), NormLaunch(1, 8, 3, 1, 2), NormLaunch(1, 8, 3, 1, 1),
            NormLaunch(1, 8, 4, 1, 0), NormLaunch(1, 8, 8, 1, 0), NormLaunch(1, 16, 2, 1, 1),
            NormLaunch(1, 16, 2, 1, 2), NormLaunch(1, 16, 4, 1, 2), NormLaunch(1, 16, 2, 1, 3),
            NormLaunch(1, 8, 0, 1, 1)]
}
# CPU dry run: every loop shape (no prefetch, one and several tiles ahead, one tile per program).
QUICK_CANDIDATES = {"fwd": [NormLaunch(2, 1, 0, 1), NormLaunch(1, 1, 2, 1, 2)],
                    "bwd": [NormLaunch(2, 1, 2, 1, 0), NormLaunch(1, 1, 2, 1, 3)]}


def _rate(ms: float, bytes_per_elem: int, rows: int, d: int, copy_tbps: float) -> dict:
    tbps = rows * d * bytes_per_elem / (ms * 1e-3) / 1e12
    return dict(ms=ms, tbps=tbps, vs_copy=tbps / copy_tbps)


def _partial_mb(launch: NormLaunch, rows: int, d: int) -> float:
    programs = min(platform.norm_programs(launch, rows), -(-rows // launch.rows))
    return programs * N_PARTIALS * d * 4 / 1e6


def _try_ms(fn, *args) -> tuple[float | None, str | None]:
    seconds, err = bench.attempt(fn, *args)
    return (None if err else seconds * 1e3), err


def _tuning(fwd: NormLaunch, bwd: NormLaunch, block_d: int) -> dict:
    return {"fwd": platform.norm_tuning_of(fwd, block_d), "bwd": platform.norm_tuning_of(bwd, block_d)}


def _fwd_bwd_s(p, tuning: dict) -> float:
    with platform.norm_tuning_override(tuning["fwd"], tuning["bwd"]):
        return bench.time_merge_fwd_bwd(p, "pallas")


def _max_rel_err(got, want) -> float:
    return max(float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _pass_outputs(p, phase: str, launch: NormLaunch):
    """The merge kernel's own outputs for one pass under `launch` (the backward from p's fixed rstd)."""
    return bench.merge_pass_fn(p, phase, launch)(p)


def _max_rel_err_vs_xla(p, tuning: dict) -> float:
    """Largest relative error over all outputs and gradients of the merge's forward+backward against XLA."""
    with platform.norm_tuning_override(tuning["fwd"], tuning["bwd"]):
        got = bench._norm_fns("merge_rms_norm", "pallas")[1](p)
    return _max_rel_err(got, bench._norm_fns("merge_rms_norm", "xla")[1](p))


def study(rows: int, d: int, copy_tbps: float, candidates: dict, keep_going, report: dict, save) -> dict:
    """XLA, the table's launches (`old`) and `candidates` per pass, then old vs best end to end, into `report`
    (save() after each stage). keep_going() -> False: no new candidate starts (the table's rows always run).
    Returns the fastest launch per pass."""
    block_d = platform.next_pow2(d)
    old = {ph: platform.norm_launch(block_d, ph) for ph in ("fwd", "bwd")}
    report.update(rows=rows, d=d, pass_bytes_per_elem=PASS_BYTES,
                  old_launch={ph: dataclasses.asdict(L) for ph, L in old.items()})
    p = bench.norm_problem(rows, d)

    xla_fwd = bench.time_call(bench._norm_fns("merge_rms_norm", "xla")[0], p) * 1e3
    xla_fb = bench.time_merge_fwd_bwd(p, "xla") * 1e3
    report["xla"] = dict(fwd=_rate(xla_fwd, PASS_BYTES["fwd"], rows, d, copy_tbps),
                         bwd_derived=_rate(xla_fb - xla_fwd, PASS_BYTES["bwd"], rows, d, copy_tbps),
                         fwd_bwd=_rate(xla_fb, sum(PASS_BYTES.values()), rows, d, copy_tbps))
    print(f"xla fwd {xla_fwd:.4f} ms, fwd+bwd {xla_fb:.4f} ms", flush=True)
    save()

    passes = {}
    for phase, launches in candidates.items():
        seen, out = set(), []
        old_outputs = _pass_outputs(p, phase, old[phase])
        for launch in [old[phase], *launches]:
            if launch in seen:
                continue
            seen.add(launch)
            row = dict(dataclasses.asdict(launch), old=launch == old[phase])
            if phase == "bwd":
                row["partial_mb"] = _partial_mb(launch, rows, d)
            if not row["old"] and not keep_going():
                out.append(dict(row, skipped="budget"))
                continue
            ms, err = _try_ms(bench.time_norm_pass, p, phase, launch)
            if err:
                row["error"] = err
                print(f"  {phase} {launch}: {err[:120]}", flush=True)
            else:
                row.update(_rate(ms, PASS_BYTES[phase], rows, d, copy_tbps),
                           max_rel_diff_vs_old=_max_rel_err(_pass_outputs(p, phase, launch), old_outputs))
                if row["max_rel_diff_vs_old"] > MAX_REL_DIFF:
                    row["rejected"] = f"outputs differ from the table row's by more than {MAX_REL_DIFF:g}"
                print(f"  {phase} {launch}: {ms:.4f} ms ({row['vs_copy']:.3f} copy, "
                      f"rel diff vs old {row['max_rel_diff_vs_old']:.1e})", flush=True)
            out.append(row)
        passes[phase] = out
        report["passes"] = passes
        save()

    best = {}
    for phase, out in passes.items():
        timed = [r for r in out if "ms" in r and r["max_rel_diff_vs_old"] <= MAX_REL_DIFF]
        if not timed:  # every launch failed: the end-to-end rows below report the error
            best[phase] = old[phase]
            continue
        fastest = min(timed, key=lambda r: r["ms"])
        best[phase] = NormLaunch(**{f.name: fastest[f.name] for f in dataclasses.fields(NormLaunch)})
    report["best"] = {ph: dataclasses.asdict(L) for ph, L in best.items()}

    fb_bytes = sum(PASS_BYTES.values())
    end_to_end = {}
    for name, (fwd, bwd) in (("old", (old["fwd"], old["bwd"])), ("new", (best["fwd"], best["bwd"]))):
        tuning = _tuning(fwd, bwd, block_d)
        ms, err = _try_ms(_fwd_bwd_s, p, tuning)
        if err:
            end_to_end[name] = dict(error=err)
            continue
        end_to_end[name] = dict(_rate(ms, fb_bytes, rows, d, copy_tbps), vs_xla=xla_fb / ms,
                                max_rel_err_vs_xla=_max_rel_err_vs_xla(p, tuning),
                                table_rows={ph: dataclasses.asdict(t) for ph, t in tuning.items()})
        e = end_to_end[name]
        print(f"merge fwd+bwd {name}: {ms:.4f} ms ({e['vs_copy']:.3f} copy, {e['vs_xla']:.2f}x XLA, "
              f"rel err {e['max_rel_err_vs_xla']:.1e})", flush=True)
    report["end_to_end"] = end_to_end
    save()
    return best


def run(out_path: str, budget_s: float, quick: bool) -> dict:
    t0 = time.perf_counter()
    report = dict(device=bench.device_summary())

    def save():
        report["elapsed_s"] = time.perf_counter() - t0
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1, default=str)

    copy = bench.copy_ceiling_tbps(2 ** 24 if quick else 2 ** 30)
    report["copy_tbps"] = copy
    print(f"copy {copy:.2f} TB/s (read + write)", flush=True)
    rows, d = (64, 256) if quick else (ROWS, D)
    study(rows, d, copy, QUICK_CANDIDATES if quick else CANDIDATES, lambda: time.perf_counter() - t0 <= budget_s,
          report, save)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/norm.json")
    ap.add_argument("--budget-s", type=float, default=60.0, help="no new candidate starts after this many seconds")
    ap.add_argument("--quick", action="store_true", help="tiny shape, one candidate per pass (CPU dry run)")
    args = ap.parse_args()
    run(args.out, args.budget_s, args.quick)


if __name__ == "__main__":
    main()

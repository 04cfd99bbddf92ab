"""Launch-parameter sweep of the Pallas kernels: `python -m benchmarks.tune_kernels [--out FILE] [--budget-s S] [--quick]`.

For each kernel pass (attention forward, dq, dk/dv; fused residual+RMSNorm forward, backward) it times every
candidate config alone, next to the baselines of the same run (cuDNN attention, XLA's fused norm, copy bandwidth),
and prints the best config per pass plus table rows to paste into pallas_kernels/platform.py (`_ATTENTION`,
`_NORM`). Attention candidates run at B=4, T=4096 (8 q / 2 kv heads, d=128, causal); the fastest few per pass
are re-timed at B=1, T=32768, and the config chosen for the table is the one with the smallest summed time
relative to each shape's best. Finally the chosen configs run end to end (forward + backward through the custom
VJP) against cuDNN and XLA, with an output check against cuDNN. Medians of repeated timings (benchmarks/kernels/bench).

Compile time dominates, so the candidate lists are short and every stage stops starting new candidates once its
share of --budget-s is spent (each pass's current table entry is timed first). --quick: tiny shapes for a CPU dry
run of the same code path (interpret mode: the timings mean nothing there).
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
from benchmarks.kernels import tune_norm
from pallas_kernels.platform import AttentionBlocks

H, KV, D = 8, 2, 128

# Per pass: (fields replaced in the table's entry). Stacked heads (`dkv_heads`) put 128 query rows of 32-64
# positions in a dk/dv tile (finer causal tiles) and widen the query side of its matmuls beyond 32.
ATTENTION_CANDIDATES = {
    "fwd": [
        dict(fwd_q=128, fwd_k=64, fwd_warps=8, fwd_stages=3),
        dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=2),
        dict(fwd_q=64, fwd_k=64, fwd_warps=4, fwd_stages=3),
    ],
    "dq": [
        dict(dq_q=128, dq_k=64, dq_warps=8, dq_stages=3),
        dict(dq_q=128, dq_k=32, dq_warps=8, dq_stages=4),
        dict(dq_q=128, dq_k=128, dq_warps=8, dq_stages=2),
    ],
    "dkv": [
        dict(dkv_q=32, dkv_k=128, dkv_warps=8, dkv_stages=3, dkv_heads=1),
        dict(dkv_q=32, dkv_k=64, dkv_warps=8, dkv_stages=3, dkv_heads=4),
        dict(dkv_q=16, dkv_k=128, dkv_warps=8, dkv_stages=3, dkv_heads=4),
        dict(dkv_q=32, dkv_k=128, dkv_warps=8, dkv_stages=3, dkv_heads=2),
        dict(dkv_q=16, dkv_k=64, dkv_warps=4, dkv_stages=3, dkv_heads=4),
        dict(dkv_q=32, dkv_k=64, dkv_warps=4, dkv_stages=3, dkv_heads=2),
        dict(dkv_q=64, dkv_k=64, dkv_warps=8, dkv_stages=3, dkv_heads=1),
        dict(dkv_q=32, dkv_k=128, dkv_warps=8, dkv_stages=4, dkv_heads=1),
        dict(dkv_q=32, dkv_k=64, dkv_warps=8, dkv_stages=2, dkv_heads=4),
    ],
}
LONG_SHAPE_TOP = 3  # fastest configs per pass re-timed at T=32768

# Share of the budget after which each stage stops starting new candidates.
STAGE_END = {"baselines": 0.12, "norm": 0.25, "attention_short": 0.62, "attention_long": 0.82}


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def open(self, stage: str) -> bool:
        return self.elapsed() < STAGE_END[stage] * self.budget


def _key(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


# ---------------------------------------------------------------------------------------------------- baselines
def attention_baselines(shapes, cuda: bool):
    out = {}
    for B, T in shapes:
        q, k, v, do = bench._attention_problem(B, T, H, KV, D)
        entry = {}
        impls = (["cudnn"] if cuda else []) + (["xla"] if T <= 8192 else [])
        for impl in impls:
            fwd, fwd_bwd = bench._attention_fns(impl, None)
            t_f, err = bench.attempt(bench.time_call, fwd, q, k, v, reps=5, calls=3)
            t_fb, err2 = bench.attempt(bench.time_call, fwd_bwd, q, k, v, do, reps=5, calls=3)
            if err or err2:
                entry[f"{impl}_error"] = err or err2
                continue
            entry[f"{impl}_fwd_ms"], entry[f"{impl}_fwdbwd_ms"] = t_f * 1e3, t_fb * 1e3
            print(f"  {impl:5s} B={B} T={T:6d}: fwd {t_f * 1e3:7.3f} ms, fwd+bwd {t_fb * 1e3:7.3f} ms", flush=True)
        out[f"T{T}"] = dict(B=B, T=T, **entry)
    return out


# ----------------------------------------------------------------------------------------------------- attention
def time_pass_configs(clock: Clock, stage: str, prob, phase: str, cfgs, base: AttentionBlocks, reps: int):
    rows = []
    for cfg in cfgs:
        if not clock.open(stage) and rows:
            rows.append(dict(cfg, skipped="budget"))
            continue
        t, err = bench.attempt(bench.time_attention_pass, prob, phase, dataclasses.replace(base, **cfg), reps=reps,
                               calls=3)
        if err:
            rows.append(dict(cfg, error=err))
            print(f"  {phase:3s} {_key(cfg)}: {err[:120]}", flush=True)
            continue
        tflops = prob.flops_fwd * bench.PASS_FLOPS[phase] / t / 1e12
        rows.append(dict(cfg, ms=t * 1e3, tflops=tflops))
        print(f"  {phase:3s} {_key(cfg)}: {t * 1e3:8.3f} ms {tflops:6.1f} TF/s  [{clock.elapsed():5.0f} s]", flush=True)
    return rows


def _cfg_of(row: dict, phase: str) -> dict:
    return {k: v for k, v in row.items() if k.startswith(phase + "_")}


def choose(short_rows, long_rows, phase: str):
    """The config with the smallest sum of (time / best time) over the shapes where it was timed at both;
    falls back to the short shape's best."""
    short = {_key(_cfg_of(r, phase)): r["ms"] for r in short_rows if "ms" in r}
    long = {_key(_cfg_of(r, phase)): r["ms"] for r in long_rows if "ms" in r}
    both = [k for k in short if k in long]
    if both:
        s_best, l_best = min(short.values()), min(long.values())
        key = min(both, key=lambda k: short[k] / s_best + long[k] / l_best)
    elif short:
        key = min(short, key=short.get)
    else:
        return None
    return next(_cfg_of(r, phase) for r in short_rows if _key(_cfg_of(r, phase)) == key)


def attention_end_to_end(shapes, variants: dict, baselines: dict):
    """Forward and forward + backward through the public API (custom VJP) for each blocks variant, with the
    ratios to cuDNN / XLA of the same run and the output's relative error to cuDNN's."""
    out = {}
    for B, T in shapes:
        q, k, v, do = bench._attention_problem(B, T, H, KV, D)
        base = baselines.get(f"T{T}", {})
        ref = None
        if "cudnn_fwd_ms" in base:
            ref = bench._attention_fns("cudnn", None)[0](q, k, v).astype(jnp.float32)
        entry = {}
        for name, blocks in variants.items():
            fwd, fwd_bwd = bench._attention_fns("pallas", blocks)
            t_f, err = bench.attempt(bench.time_call, fwd, q, k, v, reps=5, calls=3)
            t_fb, err2 = bench.attempt(bench.time_call, fwd_bwd, q, k, v, do, reps=5, calls=3)
            if err or err2:
                entry[name] = dict(error=err or err2)
                print(f"  {name} T={T}: {err or err2}", flush=True)
                continue
            row = dict(fwd_ms=t_f * 1e3, fwdbwd_ms=t_fb * 1e3,
                       fwdbwd_tflops=bench.attention_flops(B, T, H, D, True) / t_fb / 1e12)
            for impl in ("cudnn", "xla"):
                if f"{impl}_fwdbwd_ms" in base:
                    row[f"fwd_vs_{impl}"] = base[f"{impl}_fwd_ms"] / row["fwd_ms"]
                    row[f"fwdbwd_vs_{impl}"] = base[f"{impl}_fwdbwd_ms"] / row["fwdbwd_ms"]
            if ref is not None:
                o = fwd(q, k, v).astype(jnp.float32)
                row["rel_err_vs_cudnn"] = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
            entry[name] = row
            print(f"  {name:7s} B={B} T={T:6d}: fwd {row['fwd_ms']:7.3f} ms, fwd+bwd {row['fwdbwd_ms']:7.3f} ms "
                  f"({row['fwdbwd_tflops']:.0f} TF/s), vs cuDNN fwd+bwd "
                  f"{row.get('fwdbwd_vs_cudnn', float('nan')):.3f}", flush=True)
        out[f"T{T}"] = entry
    return out


def _blocks_literal(b: AttentionBlocks) -> str:
    default = AttentionBlocks()
    fields = [f"{f.name}={getattr(b, f.name)}" for f in dataclasses.fields(b)
              if getattr(b, f.name) != getattr(default, f.name)]
    return f"AttentionBlocks({', '.join(fields)})"


# ---------------------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/tune.json")
    ap.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of the sweep stages")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU dry run of the code path)")
    args = ap.parse_args()
    clock = Clock(args.budget_s)
    cuda = platform.vendor() == "cuda"
    report = dict(device=bench.device_summary(), budget_s=args.budget_s)

    def save():
        report["elapsed_s"] = clock.elapsed()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    short, long = ((1, 256), (1, 512)) if args.quick else ((4, 4096), (1, 32768))
    norm_rows, norm_d = (256, 256) if args.quick else (tune_norm.ROWS, tune_norm.D)
    table = platform.attention_blocks(D)

    print("baselines", flush=True)
    copy = bench.copy_ceiling_tbps(2 ** 24 if args.quick else 2 ** 30)
    print(f"  copy {copy:.2f} TB/s", flush=True)
    baselines = attention_baselines([short, long], cuda)
    report["baselines"] = dict(copy_tbps=copy, attention=baselines)
    save()

    print("norm (fused residual merge + RMSNorm)", flush=True)
    report["norm"] = {}
    norm_best = tune_norm.study(norm_rows, norm_d, copy, tune_norm.QUICK_CANDIDATES if args.quick else
                                tune_norm.CANDIDATES, lambda: clock.open("norm"), report["norm"], save)

    print(f"attention passes at B={short[0]} T={short[1]}", flush=True)
    prob = bench.attention_pass_problem(*short, H, KV, D, table)
    short_rows = {ph: time_pass_configs(clock, "attention_short", prob, ph, cfgs, table, reps=7)
                  for ph, cfgs in ATTENTION_CANDIDATES.items()}
    report["attention_passes"] = {f"T{short[1]}": short_rows}
    save()

    print(f"attention passes at B={long[0]} T={long[1]} (fastest {LONG_SHAPE_TOP} per pass)", flush=True)
    del prob
    prob = bench.attention_pass_problem(*long, H, KV, D, table)
    long_rows = {}
    for ph, rows in short_rows.items():
        top = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])[:LONG_SHAPE_TOP]
        long_rows[ph] = time_pass_configs(clock, "attention_long", prob, ph, [_cfg_of(r, ph) for r in top], table,
                                          reps=3)
    report["attention_passes"][f"T{long[1]}"] = long_rows
    del prob
    chosen = {}
    for ph in ATTENTION_CANDIDATES:
        cfg = choose(short_rows[ph], long_rows[ph], ph)
        if cfg:
            chosen.update(cfg)
    tuned = dataclasses.replace(table, **chosen)
    report["attention_best"] = {ph: choose(short_rows[ph], long_rows[ph], ph) for ph in ATTENTION_CANDIDATES}
    save()

    print("attention end to end (public API, custom VJP)", flush=True)
    variants = {"table": table} if tuned == table else {"table": table, "tuned": tuned}
    report["attention_end_to_end"] = attention_end_to_end([short, long], variants, baselines)
    save()

    block_d = platform.next_pow2(norm_d)
    print(f"best per pass (elapsed {clock.elapsed():.0f} s)")
    for ph, cfg in report["attention_best"].items():
        print(f"  attention {ph:3s}: {cfg}")
    for ph, L in norm_best.items():
        print(f"  norm {ph}: {L}")
    vendor = platform.vendor()
    print(f"table rows for pallas_kernels/platform.py ({vendor}):")
    print(f'  _ATTENTION["{vendor}"] = {_blocks_literal(tuned)}')
    rows = {ph: platform.norm_tuning_of(L, block_d) for ph, L in norm_best.items()}
    print(f'  _NORM["{vendor}"] = {{"fwd": {rows["fwd"]}, "bwd": {rows["bwd"]}}}')
    report["table_rows"] = dict(attention=_blocks_literal(tuned),
                                norm={ph: dataclasses.asdict(platform.norm_tuning_of(L, block_d))
                                      for ph, L in norm_best.items()})
    save()
    print(f"wrote {args.out} in {clock.elapsed():.0f} s on {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()

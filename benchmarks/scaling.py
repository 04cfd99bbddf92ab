"""Multi-GPU scaling report on the local GPUs: `python -m benchmarks.scaling --out OUT/scaling.json [--time-budget S]`.

In this order, each part in its own process (benchmarks/systems/scaling_parts.py), inside a time budget shared by
weight (a part that ends early leaves its time to the next; one that overruns is stopped and keeps what it saved):
  collectives  all-reduce / reduce-scatter / all-gather / all-to-all over 2..N GPUs, next to nccl-tests' 8 x H200
  dp           DP + ZeRO-1 weak scaling 1 -> N on the bench preset (dp_weak_scaling_efficiency_N)
  cp           context parallelism 2..N at 32k and 128k tokens: equality with one GPU, tokens/s per GPU
  restore      checkpoint saved on N GPUs, restored on N/2: the first steps after the resume equal the N-GPU run's
               (later steps: a drift curve, MoE routing amplifies reduction-order rounding)
  supervisor   N processes under launch.supervise, one killed with SIGKILL, the group resumes from a finished
               checkpoint and repeats its own first attempt's losses (timeline, steps lost)
Writes the JSON after every part and a figure next to it (same name, .png). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0). --cpu-smoke runs the same code on emulated CPU devices with tiny shapes (tests, CI).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from zaya_jax.fault.group import NVLS_OFF
from benchmarks.systems.scaling_parts import (
    NCCL_REFERENCE,
    PARTS,
    Settings,
    part_deadline,
)

from launch._cli import ArgumentParser, user_errors

MIN_PART_S = 20.0  # a part with less time than this left is skipped, not started
GRACE_S = 30.0  # past a part's deadline before it is stopped (it checks the deadline between measurements)
GPU_XLA_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"  # overlap gradient collectives with compute


def write_json_atomic(path: str, obj) -> None:
    """Written whole or not at all (a part stopped mid-write leaves its previous result)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    os.replace(tmp, path)


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/scaling.json",
                    help="the report (JSON); the figure goes beside it")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds for all parts together")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--devices", type=int, default=0, help="GPUs to use (default: all local), or emulated CPU devices")
    ap.add_argument("--cpu-smoke", action="store_true", help="emulated CPU devices, tiny shapes (no timing value)")
    ap.add_argument("--dp-layers", type=int, default=8, help="layers of the bench preset in the DP part")
    ap.add_argument("--cp-lengths", default="32768,131072", help="sequence lengths of the CP part")
    ap.add_argument("--cp-attention-impl", choices=("pallas", "xla"), default=None,
                    help="attention kernel of the CP part (default: pallas on GPU, xla with --cpu-smoke); 'xla' "
                         "materialises [S, S] scores: use it with --cp-lengths up to ~16384")
    ap.add_argument("--dp-attention-impl", choices=("xla", "pallas"), default="xla",
                    help="attention kernel of the DP part (cuDNN cannot be lowered inside its shard_map)")
    ap.add_argument("--workdir", default=None, help="scratch for training runs and logs (default: a temp dir)")
    # one part, in the child process the orchestrator starts
    ap.add_argument("--run-part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return ap


def _settings(args, n: int) -> Settings:
    if args.cpu_smoke:
        return Settings.cpu_smoke(n, cp_attention=args.cp_attention_impl or "xla")
    return Settings.gpu(n, dp_layers=args.dp_layers, cp_lengths=tuple(int(x) for x in args.cp_lengths.split(",")),
                        dp_attention=args.dp_attention_impl, cp_attention=args.cp_attention_impl or "pallas")


def _count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"benchmarks.scaling: cannot count GPUs ({e}); pass --devices N, or --cpu-smoke") from e
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _child_env(args, n: int, workdir: str) -> dict:
    env = dict(os.environ, **NVLS_OFF, PYTHONUNBUFFERED="1")
    # a cache of the caller's (the tests' own) is kept: its parts then reuse what the caller compiled
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax_cache"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        flags += [f"--xla_force_host_platform_device_count={n}", "--xla_backend_optimization_level=0"]
    else:
        flags += GPU_XLA_FLAGS.split()
        if args.devices:  # the first N GPUs only (every part, including the collectives sweep, sees N)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_child(args) -> int:
    n = args.devices
    save = lambda result: write_json_atomic(args.part_out, result)
    from benchmarks.systems.scaling_parts import run_part
    save(run_part(args.run_part, _settings(args, n), args.deadline, args.workdir, save))
    return 0


def _run_part(args, part: str, n: int, deadline: float, workdir: str, env: dict) -> tuple[dict | None, str | None]:
    out = os.path.join(workdir, f"part_{part}.json")
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--run-part", part, "--part-out", out, "--deadline",
           str(deadline), "--devices", str(n), "--workdir", workdir, "--dp-layers", str(args.dp_layers),
           "--cp-lengths", args.cp_lengths, "--dp-attention-impl", args.dp_attention_impl]
    cmd += (["--cp-attention-impl", args.cp_attention_impl] if args.cp_attention_impl else [])
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    error = None
    try:
        code = proc.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
        if code != 0:
            error = f"exit {code}" if code > 0 else f"signal {-code}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        error = f"stopped at its deadline (+{GRACE_S:.0f} s); results saved before that are kept"
    try:
        with open(out) as f:
            return json.load(f), error
    except (FileNotFoundError, json.JSONDecodeError):
        return None, error or "no result file"


def _failed_runs(part: dict) -> str | None:
    """Training runs of a part that exited badly (their log tails are in the part's JSON)."""
    bad = [k for k, v in [("", part), *part.items()] if isinstance(v, dict) and v.get("error")]
    return f"runs failed: {', '.join(k or 'main' for k in bad)} (see 'error' in the part)" if bad else None


def headline(result: dict) -> dict:
    """The few numbers the report is about."""
    parts, n, h = result["parts"], result["devices"], {}
    coll = parts.get("collectives") or {}
    ar = [r for r in coll.get("summary", []) if r["collective"] == "all_reduce"]
    if ar:
        widest = max(ar, key=lambda r: r["n"])
        h[f"all_reduce_peak_busbw_{widest['n']}"] = widest["peak_busbw"]
        h["all_reduce_fraction_of_nccl_tests_ring"] = widest["peak_busbw"] / NCCL_REFERENCE["all_reduce_busbw_ring_8gpu"]
    dp = parts.get("dp") or {}
    if f"dp_weak_scaling_efficiency_{n}" in dp:
        h[f"dp_weak_scaling_efficiency_{n}"] = dp[f"dp_weak_scaling_efficiency_{n}"]
    cp = [r for r in (parts.get("cp") or {}).get("runs", []) if "equal" in r]
    if cp:
        h["cp_all_equal"] = all(r["equal"] for r in cp)
        h["cp_checked"] = [f"{r['seq_len']}@CP{r['cp']}" for r in cp]
    if "resume_matches" in (parts.get("restore") or {}):
        h["restore_resume_matches"] = parts["restore"]["resume_matches"]
    if "resumed_and_matched" in (parts.get("supervisor") or {}):
        h["supervisor_resumed_and_matched"] = parts["supervisor"]["resumed_and_matched"]
    return h


@user_errors("benchmarks.scaling")
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.run_part:
        return run_child(args)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"benchmarks.scaling: unknown parts {unknown}; choose from {', '.join(PARTS)}")
    n = args.devices or (4 if args.cpu_smoke else _count_gpus())
    _settings(args, n)  # validates the sizes before any part starts
    workdir = args.workdir or tempfile.mkdtemp(prefix="zaya_scaling_")
    os.makedirs(workdir, exist_ok=True)
    env = _child_env(args, n, workdir)
    t_start = time.time()
    end = t_start + args.time_budget
    result = {"devices": n, "cpu_smoke": args.cpu_smoke, "time_budget_s": args.time_budget, "parts_run": parts,
              "env": {k: env.get(k) for k in ("XLA_FLAGS", *NVLS_OFF)}, "nccl_reference": NCCL_REFERENCE,
              "parts": {}, "wall_s": {}, "errors": {}, "workdir": workdir}
    png = os.path.splitext(args.out)[0] + ".png"
    for i, part in enumerate(parts):
        now = time.time()
        if end - now < (0 if args.cpu_smoke else MIN_PART_S):
            result["errors"][part] = f"skipped: {end - now:.0f} s of the time budget left"
            continue
        deadline = part_deadline(parts[i:], now, end)
        print(f"== {part} (until +{deadline - t_start:.0f} s of {args.time_budget:.0f})", flush=True)
        result["parts"][part], error = _run_part(args, part, n, deadline, workdir, env)
        result["wall_s"][part] = round(time.time() - now, 1)
        failed = _failed_runs(result["parts"][part] or {})
        error = "; ".join(filter(None, [error, failed]))
        if error:
            result["errors"][part] = error
        device = (result["parts"][part] or {}).get("device") or {}
        result["device_kind"] = result.get("device_kind") or device.get("device_kind")
        result["headline"] = headline(result)
        write_json_atomic(args.out, result)
        print(f"   {part}: {result['wall_s'][part]:.0f} s" + (f", {error}" if error else ""), flush=True)
    result["total_s"] = round(time.time() - t_start, 1)
    write_json_atomic(args.out, result)
    try:
        from benchmarks.systems.scaling_plot import plot
        plot(result, png)
    except ImportError as e:
        print(f"no figure: {e}", flush=True)
    print(json.dumps(result.get("headline", {}), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

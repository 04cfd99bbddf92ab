"""The bench-preset training run of docs/routing.md under several routings, in one process after another on the same
machine (only same-call figures compare: calls differ by up to 8% on the same code), summarised into one JSON:

    python -m benchmarks.routing_ab --out FILE [--steps 14] [--runs controller,random,round_robin,collapsed]
                                    [--repeats 1] [--config benchmarks/routing_bench_config.py]
                                    [-- EXTRA FLAGS FOR EVERY RUN]

Runs:
  controller   launch.train as configured: the balancing solve in every forward (the Pallas rounds on a GPU)
  xla_solve    the same with the XLA rounds (solve_impl 'xla')
  controller_units128  the controller with each expert's rows padded to whole 128-row tiles of the grouped GEMM
               (by default to 64-row units, the last tile of an expert running 64 rows)
  roundsN      the controller with N solve rounds (rounds12, rounds8, ...; equal shares moving more tokens)
  warmN        N solve rounds started from the stored biases instead of the medians (SOLVE_START=zero)
  no_equal_shares  the controller selecting with the solve's correction alone (groups within some 15-20% of equal,
               padded to row tiles): against controller, what equal shares cost a step net of the tiles they fill
  random       each token to a random expert and nothing solving: groups as uneven as sampling makes them, each
               padded to the grouped GEMM's row tiles, as the controller's are
  round_robin  token i to expert i mod E and nothing solving: equal groups of whole row tiles (no padding)
  collapsed    balancing.learning_rate 0: no solve, the router collapses to one expert per layer
controller against random is what the controller costs; random against round_robin what the padding of every group
to whole tiles costs; round_robin against collapsed what the rest of routing to every expert costs (one token group
and one weight read per expert instead of one). benchmarks/train_solve_variant.py replaces the routing.

Per run: tokens/s as the median over steps 3 on (compilation and warm-up before), every step's worst-layer max and min
load and share of tokens moved by equal shares (model/equal_shares.py), the last loss. Each run's workdir is removed
after it (a bench checkpoint is gigabytes). With --repeats N the list runs N times interleaved (A, B, A, B, ...;
repeat r of run A is recorded as "A#r"), and `spread` gives each run's tokens/s over its repeats: the same-call noise
that a difference between runs has to exceed."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RUNS = {
    "controller": ([], {}),
    "xla_solve": (["--config.model.overrides.solve_impl=xla"], {}),
    "controller_units128": ([], {"BLOCK_ROWS": "128"}),
    "no_equal_shares": ([], {"EQUAL_SHARES": "off"}),
    "round_robin": (["--config.balancing.learning_rate=0.0"], {"ROUTING": "round_robin"}),
    "random": (["--config.balancing.learning_rate=0.0"], {"ROUTING": "random"}),
    "collapsed": (["--config.balancing.learning_rate=0.0"], {}),
}
FIRST_TIMED_STEP = 3
TOKENS_PER_S = f"tokens_per_s_median_steps_{FIRST_TIMED_STEP}_on"  # each run's throughput figure


def command(name: str, config: str, steps: int, workdir: str, extra: list[str]) -> tuple[list[str], dict]:
    if name in RUNS:
        flags, env = RUNS[name]
    elif name.startswith("warm"):
        flags, env = [], {"SOLVE_ROUNDS": name.removeprefix("warm"), "SOLVE_START": "zero"}
    else:
        flags, env = [], {"SOLVE_ROUNDS": name.removeprefix("rounds")}
    module = "benchmarks.train_solve_variant" if env else "launch.train"
    argv = [sys.executable, "-m", module, "--config", config, f"--config.train.steps={steps}",
            "--config.train.log_every=1", "--workdir", workdir, *flags, *extra]
    return argv, env


def unknown_runs(names: list[str]) -> list[str]:
    return [n for n in names if n not in RUNS and not re.fullmatch(r"(rounds|warm)\d+", n)]


def summarize(rows: list[dict]) -> dict:
    """metrics.jsonl rows of one run -> its figures."""
    timed = [r["tokens_per_s"] for r in rows if r["step"] >= FIRST_TIMED_STEP and "tokens_per_s" in r]
    if not timed:
        raise ValueError(f"no logged step at or after step {FIRST_TIMED_STEP} has tokens_per_s")
    train = [r for r in rows if "max_load" in r]
    return {"steps": max(r["step"] for r in rows),
            TOKENS_PER_S: round(statistics.median(timed)),
            "loss_last": round(train[-1]["loss"], 4),
            "max_load": [round(r["max_load"], 3) for r in train],
            "min_load": [round(r["min_load"], 3) for r in train],
            "moved": [round(r.get("moved", 0.0), 4) for r in train]}


def schedule(names: list[str], repeats: int) -> list[tuple[str, str]]:
    """(label, run) in launch order: the list `repeats` times over, repeat r > 1 labelled 'name#r'."""
    return [(name if r == 1 else f"{name}#{r}", name) for r in range(1, repeats + 1) for name in names]


def spread(runs: dict) -> dict:
    """Per run name: tokens/s of each finished repeat, their median and (max - min) / median."""
    out = {}
    for label, entry in runs.items():
        if TOKENS_PER_S in entry:
            out.setdefault(label.split("#")[0], {"tokens_per_s": []})["tokens_per_s"].append(entry[TOKENS_PER_S])
    for figures in out.values():
        values = figures["tokens_per_s"]
        figures["median"] = statistics.median(values)
        figures["range_over_median"] = round((max(values) - min(values)) / figures["median"], 4)
    return out


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--runs", default="controller,random,round_robin,collapsed")
    ap.add_argument("--config", default="benchmarks/routing_bench_config.py")
    ap.add_argument("--repeats", type=int, default=1, help="run the list this many times, interleaved")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("extra", nargs="*", help="flags added to every run (after --)")
    args = ap.parse_args()
    names = args.runs.split(",")
    unknown = unknown_runs(names)
    if unknown:
        ap.error(f"unknown runs {unknown}; known: {sorted(RUNS)}, roundsN and warmN")
    if args.steps <= FIRST_TIMED_STEP:
        ap.error(f"--steps must exceed {FIRST_TIMED_STEP} (the first timed step)")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    report = {"what": __doc__.split("\n\n")[0], "steps": args.steps, "config": args.config, "extra": args.extra,
              "repeats": args.repeats, "runs": {}}
    for label, name in schedule(names, args.repeats):
        workdir = tempfile.mkdtemp(prefix=f"routing_ab_{name}_")
        argv, env = command(name, args.config, args.steps, workdir, args.extra)
        start = time.perf_counter()
        try:
            proc = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=args.timeout)
            entry = {"command": " ".join([*(f"{k}={v}" for k, v in env.items()), "python", *argv[1:]]),
                     "returncode": proc.returncode, "wall_s": round(time.perf_counter() - start, 1)}
            if proc.returncode == 0:
                entry.update(summarize(read_metrics(os.path.join(workdir, "metrics.jsonl"))))
            else:
                entry["stderr_tail"] = proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            entry = {"command": " ".join(["python", *argv[1:]]), "timed_out_s": args.timeout}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        report["runs"][label] = entry
        base = report["runs"].get("collapsed", {}).get(TOKENS_PER_S)
        for run in report["runs"].values():
            if base and TOKENS_PER_S in run:
                run["against_collapsed"] = round(run[TOKENS_PER_S] / base - 1, 4)
        if args.repeats > 1:
            report["spread"] = spread(report["runs"])
        print(label, json.dumps({k: v for k, v in entry.items() if k not in ("command", "stderr_tail")}), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

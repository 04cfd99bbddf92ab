"""The measured curves behind the balancing controller's design (docs/routing.md), redrawn from the recorded runs in
benchmarks/results/routing_tiny_sweep.json and routing_h200.json into one PNG of four panels:
  a  the default run (tiny preset, CPU): bias steps on the load error collapse every layer; the solve holds
  b  the default run's evaluation routing (stored biases alone) under each integration gain
  c  the bench run on the H200: the previous controller and the collapsed router against the solve, without and with
     equal shares
  d  the bench run on the H200: the share of tokens equal shares move, with 24 solve rounds (the default) and 12

python -m benchmarks.plot_routing [--out docs/routing_curves.png]"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(__file__), "results")

# (label, key in routing_tiny_sweep.json's variants): the step rules tried, then the solve
TINY_RULES = (
    ("Adam on the load error (the rule before)", "std 0.02: Adam on load error, lr 5e-3 (the previous default)"),
    ("load error x spread, gain 1", "std 0.02: load error x spread, gain 1"),
    ("fan-in router init, gain 1", "fan_in: gain 1"),
    ("solve folded in for the next microbatch",
     "std 0.02: solve, folded in after the microbatch (next microbatch routes with it)"),
    ("solve in the same microbatch, 8 rounds (the rule kept)",
     "std 0.02: solve applied in the same microbatch (this rule), 8 rounds"),
)
GAINS = ("0.25", "0.5", "1.0 (the default)", "1.5")
# (label, path in routing_h200.json) of per-step worst-layer max loads at the bench preset
BENCH_LOADS = (
    ("the controller before (Adam on the load error)", ("runs", "previous_controller_same_call")),
    ("collapsed (learning_rate 0)", ("equal_shares_kernels_tried", "calls", "1a899ae_h200", "runs", "collapsed")),
    ("the solve alone (24 rounds)", ("same_call_solve_cost", "call_A_on")),
    ("the solve + equal shares (kept)", ("equal_shares_kernels_tried", "calls", "1a899ae_h200", "runs", "controller")),
)
BENCH_MOVED = (
    ("24 rounds (kept)", ("equal_shares_kernels_tried", "calls", "1a899ae_h200", "runs", "controller")),
    ("12 rounds", ("equal_shares_h200", "more_runs", "rounds12")),
)


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def at(record: dict, path: tuple) -> dict:
    for key in path:
        record = record[key]
    return record


def gain_key(runs: dict, gain: str) -> str:
    return next(k for k in runs if k.startswith(f"learning_rate {gain.split()[0]}"))


def draw(out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tiny, bench = load("routing_tiny_sweep.json"), load("routing_h200.json")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    a, b, c, d = axes.flat

    for label, key in TINY_RULES:
        series = tiny["variants"][key]["max_load"]
        a.plot(range(1, len(series) + 1), series, label=label)
    a.set(title="a. default run (tiny, 8 experts), training", xlabel="step",
          ylabel="worst layer's max load (8 = one expert)", yscale="log")

    runs = tiny["integration_gain_study"]["runs"]
    for gain in GAINS:
        run = runs[gain_key(runs, gain)]
        b.plot(run["steps"], run["eval_max_load"], marker="o", markersize=3, label=f"gain {gain}")
    b.set(title="b. default run, evaluation (stored biases alone)", xlabel="step",
          ylabel="worst layer's eval max load", yscale="log")

    for label, path in BENCH_LOADS:
        series = at(bench, path)["max_load"]
        c.plot(range(1, len(series) + 1), series, marker="o", markersize=3, label=label)
    c.set(title="c. bench preset (16 experts), H200, training", xlabel="step",
          ylabel="worst layer's max load (16 = one expert)", yscale="log")

    for label, path in BENCH_MOVED:
        series = [100 * m for m in at(bench, path)["moved"]]
        d.plot(range(1, len(series) + 1), series, marker="o", markersize=3, label=label)
    d.set(title="d. bench preset, H200: tokens equal shares move", xlabel="step",
          ylabel="worst layer, % of the forward's tokens", ylim=(0, None))

    for ax, top in ((a, 8), (b, 8), (c, 16)):
        ax.set_yticks([t for t in (1, 1.5, 2, 4, 8, 16) if t <= top])
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (a, c):
        ax.axhline(1.5, linestyle=":", color="black", linewidth=0.8, label="1.5: the bound a run must hold")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks.plot_routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(RESULTS), "..", "docs", "routing_curves.png"))
    args = ap.parse_args(argv)
    print(draw(os.path.normpath(args.out)))


if __name__ == "__main__":
    main()

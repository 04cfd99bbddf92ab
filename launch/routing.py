"""python -m launch.routing RUN [--step N]

Prints the per-layer routing health of a training run's last logged step (or step N) from RUN/metrics.jsonl:
expert loads relative to uniform, experts below 10% of uniform, the router's mean top-1 probability, its entropy,
the token-to-token spread of its probabilities and the skip fraction."""

import json
import os

from launch._cli import ArgumentParser, UsageError, user_errors


@user_errors("launch.routing")
def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("run", help="training run directory (holds metrics.jsonl)")
    ap.add_argument("--step", type=int, default=None, help="logged step (default: the last one)")
    args = ap.parse_args(argv)
    from zaya_jax.train.routing_metrics import layer_table

    path = os.path.join(args.run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"{path} does not exist: give a training run directory")
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if any("/layer_" in k for k in row):
                rows.append(row)
    logged = [row["step"] for row in rows]
    if args.step is not None:
        rows = [row for row in rows if row["step"] == args.step]
    if not rows:
        where = "" if args.step is None else f" at step {args.step}"
        have = f" ({len(logged)} logged steps, from {logged[0]} to {logged[-1]})" if logged else ""
        raise UsageError(f"{path} has no per-layer routing metrics{where}{have}")
    print(f"step {rows[-1]['step']}")
    print(layer_table(rows[-1]))


if __name__ == "__main__":
    main()

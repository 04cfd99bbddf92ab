"""Systems characterization: `python -m benchmarks.characterize SUBCOMMAND [options]`.

    collectives  all-reduce / reduce-scatter / all-gather / broadcast / all-to-all over device groups and sizes
    hbm          read / write / copy bandwidth over sizes (XLA and Pallas)
    gemm         the model's GEMM shapes over M; the FLOP size where a GEMM saturates
    attention    attention throughput over context length (memory -> compute bound)
    breakdown    a profiled training step split by category
    storage      the Appendix B data-loading I/O model
    crosscheck   copy bandwidth and GEMM ceiling next to PyTorch's on the same GPU
    all          everything above, plus hardware.json and the advisor's ZAYA1 plan (advice.json)
    plot         redraw every PNG from the JSON files in --out (e.g. after a run on a box without matplotlib)
Each writes OUT/<name>.json and OUT/<name>.png. The logic lives in benchmarks/systems/.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

from launch._cli import ArgumentParser, user_errors


def _keep_kernels_attributable():
    """XLA's GPU command buffers replay fused kernels as graphs, which can hide which HLO op a kernel belongs to in
    a profile; turn them off for runs that profile (set before jax starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=").strip()


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m benchmarks.characterize", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name, help_):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--out", default="benchmarks/characterize", help="output directory")
        return p

    p = add("collectives", "collective bandwidth sweep")
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=None, help="default: 8 GiB on a GPU (memory-capped), 8 MiB on CPU")
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--collective", action="append", help="repeat to choose (default: all five)")
    p.add_argument("--scope", action="append", choices=("node", "rail", "global"), help="repeat (default: all)")
    p.add_argument("--local-per-node", type=int, default=None, help="emulate nodes of this many devices")
    p.add_argument("--all-rails", action="store_true", help="rail scope: every rail at once, not only rail 0")
    p.add_argument("--dtype", default="float32")

    p = add("hbm", "HBM bandwidth sweep")
    p.add_argument("--min-bytes", type=int, default=64 * 1024)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--step", type=int, default=2)

    for name, help_ in (("gemm", "GEMM sweep over the model's shapes"), ("attention", "attention crossover")):
        p = add(name, help_)
        p.add_argument("--model", default="zaya1_8b", help="model preset for the shapes")
    sub.choices["gemm"].add_argument("--m-max", type=int, default=65536)
    sub.choices["attention"].add_argument("--impl", default=None, help="xla | cudnn | pallas (default: per platform)")
    sub.choices["attention"].add_argument("--tokens", type=int, default=32768)
    sub.choices["attention"].add_argument("--max-len", type=int, default=32768)

    for name, help_ in (("breakdown", "profiled training-step breakdown"), ("all", "every measurement")):
        p = add(name, help_)
        p.add_argument("--preset", default="bench", help="model preset of the profiled step")
        p.add_argument("--seq-len", type=int, default=4096)
        p.add_argument("--rows", type=int, default=2, help="sequences per step, all devices together")
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--devices", type=int, default=0, help="data-parallel devices (0: all)")
        p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
        p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                       help="ModelConfig field of the profiled model, e.g. attention_impl=cudnn (repeatable)")
    sub.choices["breakdown"].add_argument("--keep-trace", action="store_true")
    sub.choices["all"].add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    sub.choices["all"].add_argument("--local-per-node", type=int, default=None)
    sub.choices["all"].add_argument("--stages", default=None, help="comma-separated subset of: crosscheck, hbm, "
                                    "gemm, attention, collectives, breakdown, storage, advice")

    p = add("storage", "data-loading I/O model")
    p.add_argument("--global-batch-tokens", type=int, default=2 ** 24)
    p.add_argument("--token-bytes", type=int, default=4)
    p.add_argument("--iteration-s", type=float, default=2.5)
    p.add_argument("--iops-budget", type=float, default=70_000)
    p.add_argument("--sigma", type=float, action="append", help="scatter factors (default 1 2 4 8)")
    add("crosscheck", "ceilings vs PyTorch")
    add("plot", "redraw the figures from the JSON files")
    return ap


def _override(text: str) -> tuple:
    field, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--override wants FIELD=VALUE, got {text!r}")
    try:
        return field, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return field, value  # a bare word such as cudnn


def _breakdown_config(args, quick: bool = False):
    from benchmarks.systems.breakdown import BreakdownConfig
    overrides = tuple(_override(o) for o in args.override)
    if args.layers:
        overrides += (("num_hidden_layers", args.layers),)
    if quick:
        return BreakdownConfig(preset="tiny", overrides=(("num_hidden_layers", 2),) + overrides, seq_len=64, rows=4,
                               steps=2,
                               devices=args.devices or 2, prefetch=0, fast_cpu_compile=True)
    return BreakdownConfig(preset=args.preset, overrides=overrides, seq_len=args.seq_len, rows=args.rows,
                           steps=args.steps, devices=args.devices)


@user_errors("benchmarks.characterize")
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd in ("breakdown", "all"):
        _keep_kernels_attributable()
    import jax.numpy as jnp

    from zaya_jax.config import preset
    from benchmarks.systems import (attention_sweep, breakdown, collective_sweep, crosscheck, gemm, hbm, storage,
                                  suite)
    from benchmarks.systems.conventions import COLLECTIVE_NAMES

    out = args.out
    if args.cmd == "collectives":
        collective_sweep.run(out, min_bytes=args.min_bytes, max_bytes=args.max_bytes, step=args.step,
                             names=tuple(args.collective or COLLECTIVE_NAMES),
                             scopes=tuple(args.scope or ("node", "rail", "global")),
                             local_per_node=args.local_per_node, all_rails=args.all_rails, dtype=jnp.dtype(args.dtype))
    elif args.cmd == "hbm":
        hbm.run(out, min_bytes=args.min_bytes, max_bytes=args.max_bytes, step=args.step)
    elif args.cmd == "gemm":
        gemm.run(preset(args.model), out, m_max=args.m_max)
    elif args.cmd == "attention":
        attention_sweep.run(preset(args.model), out, impl=args.impl, tokens=args.tokens, max_len=args.max_len)
    elif args.cmd == "breakdown":
        breakdown.run(_breakdown_config(args), out, keep_trace=args.keep_trace)
    elif args.cmd == "storage":
        case = storage.StorageCase(iteration_bytes=storage.bytes_per_iteration(args.global_batch_tokens,
                                                                               args.token_bytes),
                                   iteration_s=args.iteration_s, iops_budget=args.iops_budget,
                                   sigmas=tuple(args.sigma or (1, 2, 4, 8)))
        storage.run(case, out)
    elif args.cmd == "crosscheck":
        crosscheck.run(out)
    elif args.cmd == "plot":
        suite.redraw(out)
    elif args.cmd == "all":
        stages = tuple(args.stages.split(",")) if args.stages else suite.STAGES
        unknown = set(stages) - set(suite.STAGES)
        if unknown:
            raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {suite.STAGES}")
        suite.run(suite.SuiteConfig(quick=args.quick, stages=stages, breakdown=_breakdown_config(args, args.quick),
                                    local_per_node=args.local_per_node), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the balancing controller's time goes inside a training microbatch: the forward and backward of the bench run
(benchmarks/routing_bench_config.py: configs/zaya1_base.py's kernels at the bench preset, one microbatch of 2 x 4096
tokens, fresh random weights) traced twice, with the controller on (the solve and equal shares in every layer) and off
(balancing.learning_rate 0: selection by the stored biases). Kernels are attributed to the model source line that
emitted them (in the optimized modules XLA dumps during the run, as benchmarks/profile_decode.py reads them). Per
mode: kernel time and launches, the GPU's idle time between kernels, and
the kernels of the routing's own files (the solve, equal shares, the statistics); then the source lines whose time
differs most between the modes. The bf16 GEMM ceiling is printed first. With --whole-step, one optimizer step of the
trainer's own program instead (its 16 microbatches, deferred expert gradients and bias updates), over random tokens,
each mode's calls also timed untraced, and two more modes with nothing solving (benchmarks/routing_baselines.py):
round_robin (token i to expert i mod E) gives the controller's equal groups at no balancing cost, which the stored
biases of fresh weights (off) do not; collapsed (every token to one expert) the workload of the collapsed router the
controller replaced.

python -m benchmarks.profile_routing [--out FILE.json] [--whole-step [--init-from RUN]]
                                     [--modes controller,off,round_robin,collapsed,random]
                                     [--preset tiny: a smoke test on 2 x 256 tokens]"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.routing_baselines import ROUTINGS, replace_routing
from benchmarks.routing_bench_config import get_config
from benchmarks.kernels.bench import gemm_ceiling_tflops
from benchmarks.profile_decode import dump_optimized_hlo, kernel_tables
from benchmarks.training.bench_programs import make_batch
from zaya_jax.config import preset
from zaya_jax.model.base import BalancingBias
from zaya_jax.model.router import Router
from zaya_jax.model.zaya import ZayaForCausalLM
from zaya_jax.train.init_from import initialize_from
from zaya_jax.train.program import build_train_program, graphdef_of
from zaya_jax.train.step import make_loss_fn

ROUTING_FILES = ("router.py", "equal_shares.py", "routing_stats.py", "balancing_solve.py", "group_quota.py",
                 "_order_search.py")
TOP = 400  # source lines kept per mode: all that differ between them
WALL_REPEATS = 5  # untraced calls timed per mode, the median kept


def figures(run, dump: str, unit: str) -> dict:
    """Times run() (after a first, compiling call), then traces one more and sums its kernels by source line."""
    run()
    walls = []
    for _ in range(WALL_REPEATS):
        t0 = time.perf_counter()
        run()
        walls.append((time.perf_counter() - t0) * 1e3)
    tables = kernel_tables(run, dump, 1, unit, TOP)
    loads = run.loads() if hasattr(run, "loads") else {}
    sources = {row["source"]: row[f"ms_per_{unit}"] for row in tables["top_sources"]}
    counts = {row["source"]: row[f"calls_per_{unit}"] for row in tables["top_sources"]}
    routing = {k: t for k, t in sources.items() if any(f in k for f in ROUTING_FILES)}
    return {**loads, "wall_ms_median": round(statistics.median(walls), 3), "wall_ms": [round(w, 3) for w in walls],
            "kernel_ms": round(tables[f"kernel_ms_per_{unit}"], 3),
            "idle_ms": round(tables["idle"].get(f"idle_in_span_ms_per_{unit}", 0), 3),
            "kernels": tables[f"kernels_per_{unit}"], "routing_ms": round(sum(routing.values()), 3),
            "routing_launches": sum(counts[k] for k in routing), "routing_sources_ms": routing,
            "sources_ms": sources, "source_launches": counts, "source_lookup": tables["source_lookup"]}


def microbatch_runner(config, cfg, seq: int, on: bool):
    """value_and_grad of the train loss on one microbatch of 2 x seq tokens (fresh weights)."""
    _, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=0), nnx.Param, BalancingBias)
    args = (nnx.to_pure_dict(params), nnx.to_pure_dict(model_state), make_batch(cfg, 2, seq))
    loss = make_loss_fn(graphdef_of(cfg, 0), False, ce_chunk_tokens=config.train.ce_chunk_tokens, balance_tokens=on,
                        solve=on)
    compiled = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def step_runner(config, on: bool, routing: str | None = None, init_from: str = ""):
    """One optimizer step of the trainer's own program (build_train_program: the accumulating step, its deferred
    expert gradients, the bias update) over random tokens, the state carried from call to call; routing: a baseline
    of benchmarks/routing_baselines.py patched into the router while the program traces; init_from: a run of this
    config whose weights and biases to start from (a trained router: the solve's searches take more passes on its
    clustered scores than on fresh weights' near-uniform ones)."""
    config = copy.deepcopy(config)
    if not on:
        config.balancing.learning_rate = 0.0
    restore = Router.__call__
    if routing:
        replace_routing(routing)
    try:
        prog = build_train_program(config, log=None)
        plan = prog.plan
        batches = jax.device_put(make_batch(plan.model, plan.micro_rows, plan.seq_len, accum=plan.accumulation),
                                 prog.batch_sharding)
        step = prog.step.lower(prog.state, batches).compile()  # traced here, with the routing in place
    finally:
        Router.__call__ = restore
    state = initialize_from(init_from, prog.state, plan.model) if init_from else prog.state
    box = [state, None]  # the state, the last step's metrics

    def run():
        box[0], box[1] = step(box[0], batches)
        jax.block_until_ready(box[1])

    # the worst layer's loads of the last step run, read once the timing is over
    run.loads = lambda: {k: round(float(f(box[1][f"routing/{k}"])), 3) for k, f in (("max_load", jnp.max),
                                                                                     ("min_load", jnp.min))}
    return run


def main(argv=None):
    config = get_config()
    ap = argparse.ArgumentParser(prog="benchmarks.profile_routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the figures here (JSON), re-written as each mode ends")
    ap.add_argument("--preset", default=config.model.preset, choices=[config.model.preset, "tiny"],
                    help="'tiny': a smoke test on 2 x 256 tokens")
    ap.add_argument("--modes", default=None,
                    help="comma-separated modes to run (default: controller,off, and with --whole-step also "
                         "round_robin,collapsed; random too on request: benchmarks/routing_baselines.py)")
    ap.add_argument("--init-from", default="",
                    help="with --whole-step: start every mode from this run's weights and biases (a run of "
                         "benchmarks/routing_bench_config.py, e.g. 30 steps of launch.train) instead of fresh ones")
    ap.add_argument("--whole-step", action="store_true",
                    help="profile one optimizer step of the trainer's program (16 microbatches at the bench preset) "
                         "instead of one microbatch's forward and backward")
    args = ap.parse_args(argv)
    if args.init_from and not args.whole_step:
        ap.error("--init-from needs --whole-step")
    dump = dump_optimized_hlo()  # before the backend starts
    if args.preset == "tiny":
        config.model.preset = "tiny"
        config.data.seq_len = 256
        config.train.update(microbatch_tokens=512, global_batch_tokens=2 * 512)
    cfg = preset(config.model.preset, **dict(config.model.overrides))
    ceiling = gemm_ceiling_tflops(8192)
    print(f"bf16 GEMM ceiling {ceiling:.0f} TFLOP/s", flush=True)
    modes = {}
    runs = (("controller", True, None), ("off", False, None)) + (
        tuple((routing, False, routing) for routing in ROUTINGS) if args.whole_step else ())
    wanted = args.modes.split(",") if args.modes else [name for name, _, _ in runs if name != "random"]
    unknown = sorted(set(wanted) - {name for name, _, _ in runs})
    if unknown:
        ap.error(f"--modes: unknown {unknown}; known here: {[name for name, _, _ in runs]}")
    runs = tuple(run for run in runs if run[0] in wanted)
    for name, on, routing in runs:
        if args.whole_step:
            modes[name] = figures(step_runner(config, on, routing, args.init_from), dump, "step")
        else:
            modes[name] = figures(microbatch_runner(config, cfg, config.data.seq_len, on), dump, "microbatch")
        m = modes[name]
        print(f"{name}: loads {m.get('max_load')} / {m.get('min_load')}, wall {m['wall_ms_median']} ms (median of "
              f"{WALL_REPEATS}), kernels {m['kernel_ms']} ms ({m['kernels']} launches), idle {m['idle_ms']} ms, "
              f"routing files {m['routing_ms']} ms ({m['routing_launches']} launches)", flush=True)
        for k, t in list(m["routing_sources_ms"].items())[:12]:
            print(f"    {t:8.3f}  {k}")
        save(args.out, modes, ceiling)  # each mode as it finishes: a run cut short keeps what it measured
    unit = "step" if args.whole_step else "microbatch"
    differences = {}
    for base in [name for name in modes if name != "controller" and "controller" in modes]:
        differences[base] = largest_differences(modes["controller"], modes[base])
        print(f"largest differences, controller - {base} (ms and launches per {unit}):")
        for k, d, n in differences[base]:
            print(f"    {d:+8.3f} {n:+6.0f}  {k}")
    save(args.out, modes, ceiling, differences=differences)


def largest_differences(on: dict, base: dict, top: int = 25) -> list:
    """[source, ms, launches] of the source lines whose kernel time differs most between two modes."""
    keys = set(on["sources_ms"]) | set(base["sources_ms"])
    rows = [[k, round(on["sources_ms"].get(k, 0) - base["sources_ms"].get(k, 0), 3),
             on["source_launches"].get(k, 0) - base["source_launches"].get(k, 0)] for k in keys]
    return sorted(rows, key=lambda r: (-abs(r[1]), -abs(r[2])))[:top]


def save(out: str | None, modes: dict, ceiling: float, **extra):
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, gemm_ceiling_tflops=round(ceiling), modes=modes,
                           **extra), f, indent=1)


if __name__ == "__main__":
    main()

"""Iteration-time breakdown of a real training step (the paper's tagged-profile figure, spec section 15).

Builds the trainer's own program (zaya_jax/train/program.py build_train_program, what zaya_jax/train/loop.py runs)
from a config made of the breakdown's on top of configs/default.py: mesh, Muon + AdamW with ZeRO-1, per-device
gradients reduced explicitly on several devices, the jitted accumulating step (one microbatch per step here) with
the state donated; batches come from the trainer's data iterator over the built-in corpus. It compiles that step
once, profiles a few steps with jax.profiler, and attributes every executed op to attention / experts / router /
norms / embedding+head+loss / optimizer / communication / other through the Python stack XLA recorded for its HLO
instruction (hlo_frames of the compiled executable's text + op_classes). Host time spent making
and transferring batches is measured through a 'data_loading' annotation. On a GPU the kernels of one stream run
one after another, so category times add up to the busy time of the step; XLA:CPU runs thunks on several threads
at once, so on the CPU shares are of summed op time.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import tempfile
import time

import jax
from ml_collections import ConfigDict

from configs.default import get_config
from zaya_jax.data import builtin_corpus, load_tokenizer, train_iterator
from zaya_jax.optim.balancing import BalancerConfig
from zaya_jax.optim.optimizer import OptimizerConfig
from benchmarks.systems import hlo_frames, memory_model, op_classes, plots, profile_trace
from benchmarks.systems.op_classes import CATEGORIES
from benchmarks.systems.report import table, write_json
from zaya_jax.train.loop import stacked_on_devices
from zaya_jax.train.program import build_train_program


@dataclasses.dataclass(frozen=True)
class BreakdownConfig:
    preset: str = "bench"
    overrides: tuple = ()  # (name, value) pairs for the ModelConfig
    seq_len: int = 4096
    rows: int = 2  # sequences per step, all devices together
    steps: int = 3  # profiled steps (after one untimed compile + warm-up step)
    devices: int = 0  # data-parallel devices; 0 = all
    prefetch: int = 2
    fast_cpu_compile: bool = False  # CPU smoke runs: LLVM at -O0 (HLO passes unchanged; timings not meaningful)


def _batches(cfg, bc: BreakdownConfig, vocab_size: int, log=print):
    """The trainer's data iterator over the built-in corpus (byte tokens); without background prefetch when its
    prefetch library is missing (then data loading shows up in full on the step)."""
    tok = load_tokenizer("byte")
    corpus = builtin_corpus(tok)
    kw = dict(seq_len=bc.seq_len, global_batch=bc.rows, seed=0, vocab_size=vocab_size)
    try:
        return train_iterator(corpus.train, {name: 1.0 for name in corpus.train}, prefetch=bc.prefetch, **kw)
    except ImportError as e:
        log(f"  prefetch unavailable ({e}); loading batches in the step's thread")
        return train_iterator(corpus.train, {name: 1.0 for name in corpus.train}, prefetch=0, **kw)


def train_config(bc: BreakdownConfig) -> ConfigDict:
    """The trainer's config of a breakdown: configs/default.py with its model (the preset and overrides as given),
    one microbatch of `rows` x `seq_len` per optimizer step, the data-parallel mesh over `devices`, the default
    parallelism of configs/default.py (ZeRO-1), the optimizer and bias controller the breakdown has always used."""
    c = get_config()
    c.seed = 0
    c.model = ConfigDict(dict(preset=bc.preset, overrides=ConfigDict(dict(bc.overrides))))
    c.data.seq_len = bc.seq_len
    tokens = bc.rows * bc.seq_len
    c.train.update(steps=1, global_batch_tokens=tokens, microbatch_tokens=tokens)
    c.optim = ConfigDict(dataclasses.asdict(OptimizerConfig(warmup_steps=10, total_steps=1000)))
    c.balancing = ConfigDict(dataclasses.asdict(BalancerConfig()))
    c.mesh = ConfigDict(dict(data=-1, context=1, num_devices=bc.devices))
    return c


def profile(bc: BreakdownConfig, logdir: str | None = None, log=print) -> dict:
    program = build_train_program(train_config(bc), log=log)
    cfg, mesh, state = program.model, program.mesh, program.state
    it = _batches(cfg, bc, cfg.vocab_size, log)

    def next_batch():  # one microbatch per step, stacked [1, rows, ...] as the trainer puts it on the devices
        with jax.profiler.TraceAnnotation("data_loading"):
            return jax.block_until_ready(stacked_on_devices([next(it)], program.batch_sharding))

    t0 = time.perf_counter()
    # the trainer's jitted step (its own compiler options, shardings and donation); only the CPU attribution
    # options are added here
    compiled = program.step.lower(state, next_batch()).compile(compiler_options=_compile_options(bc))
    compile_s = time.perf_counter() - t0
    index = hlo_frames.parse(compiled.as_text())
    memory = memory_comparison(cfg, compiled, bc, mesh.devices.size, zero1=program.parallel.zero1)
    state, _ = compiled(state, next_batch())  # warm-up: first-run allocations and autotuning stay out of the trace
    jax.block_until_ready(state)

    logdir = logdir or tempfile.mkdtemp(prefix="zaya_breakdown_")
    walls = []
    with jax.profiler.trace(logdir):
        for i in range(bc.steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                t = time.perf_counter()
                state, metrics = compiled(state, next_batch())
                jax.block_until_ready((state, metrics))
                walls.append(time.perf_counter() - t)
    it.close()
    ops, marks, lines = profile_trace.load(logdir)
    result = attribute(ops, marks, index, steps=bc.steps)
    result.update(config=dict(dataclasses.asdict(bc), model=bc.preset, devices=mesh.devices.size,
                              parallel=dataclasses.asdict(program.parallel)),
                  step_wall_s=sum(walls) / len(walls), compile_s=compile_s, trace_dir=logdir, trace_lines=lines,
                  tokens_per_step=bc.rows * bc.seq_len, memory=memory)
    log(f"  step {result['step_wall_s'] * 1e3:.1f} ms, {len(ops)} ops from {len(lines)} trace lines")
    return result


def _compile_options(bc: BreakdownConfig) -> dict | None:
    """XLA:CPU's XNNPACK fusions drop the op metadata (and so the Python stack) of what they fuse; compile without
    them so every CPU op can be attributed. GPU fusions keep their metadata."""
    if jax.default_backend() != "cpu":
        return None
    options = {"xla_cpu_experimental_ynn_fusion_type": ""}
    if bc.fast_cpu_compile:
        options["xla_backend_optimization_level"] = 0
    return options


def memory_comparison(cfg, compiled, bc: BreakdownConfig, devices: int, zero1: bool = False) -> dict:
    """The memory model's prediction for this step (recipe zaya_jax, with the program's ZeRO-1 setting) next to
    XLA's allocation for it: the check of the model on the backend at hand (a GPU in the suite)."""
    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    recipe = dataclasses.replace(memory_model.zaya_jax_recipe(cfg), zero1=zero1)
    predicted = memory_model.step_memory(cfg, recipe, memory_model.Parallel(dp=devices), bc.seq_len,
                                         max(1, bc.rows // devices))
    return dict(compiled_peak=peak, compiled_temporaries=ma.temp_size_in_bytes, predicted=predicted,
                predicted_over_compiled=predicted["total"] / peak)


def attribute(ops, marks, index: hlo_frames.HloIndex, steps: int) -> dict:
    """Seconds per step in each category (ops of other compiled modules are left out; kernels without an HLO op,
    such as library collectives on a GPU stream, are classified by name)."""
    per_cat = collections.Counter({c: 0.0 for c in CATEGORIES})
    by_op = collections.Counter()
    unknown = 0
    for e in ops:
        if e.hlo_module is not None and not _same_module(e.hlo_module, index.module):
            continue
        instr = index.get(e.hlo_op) if e.hlo_op else None
        if e.hlo_op and instr is None:
            unknown += 1
        if op_classes.is_container(instr):
            continue
        cat = op_classes.classify(instr, e.name)
        per_cat[cat] += e.duration_ns * 1e-9
        by_op[(cat, e.hlo_op or e.name)] += e.duration_ns * 1e-9
    per_cat["data_loading"] = sum(m.duration_ns for m in marks) * 1e-9
    seconds = {c: per_cat[c] / steps for c in CATEGORIES}
    total = sum(seconds.values()) or 1.0
    top = [dict(category=c, op=o, seconds_per_step=s / steps) for (c, o), s in by_op.most_common()]
    top = [t for c in CATEGORIES for t in [t for t in top if t["category"] == c][:3]]  # the 3 largest per category
    return dict(seconds_per_step=seconds, share={c: seconds[c] / total for c in CATEGORIES}, top_ops=top,
                unmatched_ops=unknown, module=index.module)


def _same_module(event_module: str, compiled_module: str) -> bool:
    # profilers may decorate the module name with a program id, e.g. 'jit_train_step(12)'
    return event_module == compiled_module or event_module.split("(")[0] == compiled_module


def summary_table(result: dict) -> str:
    rows = [dict(category=c, ms=result["seconds_per_step"][c] * 1e3, pct=100 * result["share"][c])
            for c in CATEGORIES]
    return table(rows, [("category", "category", ""), ("ms", "ms/step", ".2f"), ("pct", "% of time", ".1f")])


def plot(result: dict, path: str) -> str:
    return plots.bars(path, list(CATEGORIES), [100 * result["share"][c] for c in CATEGORIES], ylabel="% of step",
                      title=f"iteration-time breakdown ({result['config']['model']}, "
                            f"{result['tokens_per_step']} tokens/step)")


def run(bc: BreakdownConfig, out_dir: str, keep_trace: bool = False, log=print) -> dict:
    """keep_trace: leave the raw trace in out_dir/breakdown_trace (for TensorBoard / xprof) instead of a temp dir."""
    result = profile(bc, logdir=os.path.join(out_dir, "breakdown_trace") if keep_trace else None, log=log)
    write_json(f"{out_dir}/breakdown.json", result)
    plots.try_plot(plot, result, f"{out_dir}/breakdown.png", log)
    log(summary_table(result))
    return result

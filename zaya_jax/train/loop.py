"""The trainer: mesh -> model + params -> optimizer -> data -> checkpoint manager (restores when a checkpoint
exists) -> loop of the jitted train step (one call per optimizer step, its k microbatches stacked) with evaluation
and checkpoint cadences."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from zaya_jax.checkpoint.manager import CheckpointManager, abstract_like
from zaya_jax.data import builtin_corpus, load_tokenizer, train_iterator
from zaya_jax.fault.control import beat, read_control, skipped
from zaya_jax.fault.inject import FaultInjector
from zaya_jax.optim.optimizer import OptimizerConfig, learning_rates, partition_table
from zaya_jax.parallel.config import ParallelConfig
from zaya_jax.parallel.distributed import maybe_initialize
from zaya_jax.train import run_record
from zaya_jax.train.errors import TrainConfigError
from zaya_jax.train.evaluate import Evaluator
from zaya_jax.train.flops import flops_per_token
from zaya_jax.train import routing_metrics
from zaya_jax.train.init_from import initialize_from
from zaya_jax.train.metrics import MetricsWriter, Throughput
from zaya_jax.train.options import TrainOptions
# the plan, the state and the jitted step are assembled in train/program.py (shared with the benchmarks); these
# names stay importable from here
from zaya_jax.train.program import (Plan, TrainProgram, batch_ramp, build_train_program, init_state,  # noqa: F401
                                    make_plan)

# Dense bf16 peak FLOP/s per device kind, for MFU (vendor figures; override with train.peak_tflops).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "MI300X": 1307.4, "MI325X": 1307.4, "MI355X": 2516.6, "A100": 312.0}


EXIT_NONFINITE = 65  # the trainer's exit status when the loss went NaN/Inf (no checkpoint written)
EXIT_STOPPED = 75  # stopped by SIGTERM (the supervisor, a scheduler) after finishing checkpoint writes


@dataclasses.dataclass
class Setup:
    """Everything a run or an evaluation builds from its config before touching a checkpoint: the train program
    (train/program.py: plan, mesh, optimizer, initial state, jitted step), the data sources and the checkpoint
    metadata."""

    program: TrainProgram
    train_sources: dict
    valid_sources: dict
    meta: dict

    @property
    def plan(self) -> Plan:
        return self.program.plan

    @property
    def mesh(self):
        return self.program.mesh

    @property
    def optimizer(self) -> OptimizerConfig:
        return self.program.optimizer

    @property
    def tx(self):
        return self.program.tx

    @property
    def graphdef(self):
        return self.program.graphdef

    @property
    def state(self) -> dict:
        return self.program.state

    @property
    def parallel(self) -> ParallelConfig:
        return self.program.parallel


def setup(config: ConfigDict, *, log=print) -> Setup:
    """The data sources (checked first: they cost nothing to check) and the train program (train/program.py).
    The config's groups are typed and checked once, by make_plan (train/options.py)."""
    plan = make_plan(config)
    cfg, data = plan.model, plan.options.data
    if data.training_source_names() is None:
        raise TrainConfigError("data.builtin is False and data.sources is empty: name indexed-dataset prefixes, "
                               "e.g. --config.data.sources.web=/data/web_text_document")
    tok = load_tokenizer(data.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        raise TrainConfigError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {cfg.vocab_size}")
    if data.builtin:
        corpus = builtin_corpus(tok)
        train_sources, valid_sources = corpus.train, corpus.valid
    else:  # the weights name exactly these sources (train/options.py)
        train_sources, valid_sources = dict(data.sources), dict(data.valid_sources)
    prog = build_train_program(config, log=log)
    meta = {"model": prog.model.to_hf_dict(), "seq_len": prog.plan.seq_len}
    return Setup(prog, train_sources, valid_sources, meta)


def checkpoint_manager(train: TrainOptions, workdir: str) -> CheckpointManager:
    return CheckpointManager(os.path.join(workdir, "checkpoints"), save_interval_steps=train.checkpoint_every,
                             max_to_keep=train.keep_checkpoints)


def evaluate_checkpoint(config, workdir: str, *, step: int | None = None, max_batches: int | None = None,
                        log=print) -> dict[str, float]:
    """Scores the run's checkpoint (latest, or `step`) on every held-out source; jit-compiled, any mesh.
    `config` None: the one recorded in the run directory (run_record.py). max_batches None: the config's
    train.eval_batches (what training's evaluation scored; None there: every batch)."""
    if config is None:
        config = run_record.load_config(workdir)
    if max_batches is not None and max_batches < 1:
        raise TrainConfigError(f"max_batches={max_batches} must be >= 1 (or None: every held-out batch)")
    s = setup(config, log=log)
    if not s.valid_sources:
        raise TrainConfigError("the run has no held-out sources to score: name them with "
                               "--config.data.valid_sources.NAME=PREFIX")
    if max_batches is None:  # the batches training's evaluation scored, so the figures compare with its log
        max_batches = s.plan.options.train.eval_batches
    ckpt = checkpoint_manager(s.plan.options.train, workdir)
    try:
        restored = ckpt.restore(abstract_like(s.state), step=step, expect_meta=s.meta, log=log)
    finally:  # its background threads must not outlive a failed restore
        ckpt.close()
    params, model_state = restored.state["params"], restored.state["model_state"]
    evaluator = Evaluator(s.graphdef, s.valid_sources, seq_len=s.plan.seq_len, rows=s.plan.micro_rows, mesh=s.mesh,
                          max_batches=max_batches, reset_at_documents=s.plan.options.data.reset_at_documents)
    out = evaluator(params, model_state)
    log(f"{os.path.join(workdir, 'checkpoints')} step {restored.step}: " +
        " ".join(f"{k}={v:.4f}" for k, v in out.items()))
    return {"step": restored.step, **out}


def run(config: ConfigDict, workdir: str, *, log=print) -> dict:
    """Trains; what it opened (metrics writer, checkpoint manager, data iterator) is closed on every exit path:
    an exception leaves no writer thread behind (TensorBoard's fails loudly at interpreter exit)."""
    closers = []
    try:
        return _run(config, workdir, log=log, closers=closers)
    except BaseException as e:
        for close in reversed(closers):
            try:
                close()
            except Exception as e2:  # the original error matters more
                log(f"while stopping: {type(e2).__name__}: {e2}")
        if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
            first = str(e).strip().splitlines()[0]
            raise TrainConfigError(f"the step does not fit in device memory ({first}): lower "
                                   "train.microbatch_tokens or data.seq_len, or set "
                                   "--config.model.overrides.remat=full") from e
        raise


def _run(config: ConfigDict, workdir: str, *, log, closers: list) -> dict:
    maybe_initialize()
    run_record.check_workdir(workdir)
    os.makedirs(workdir, exist_ok=True)
    lead = jax.process_index() == 0
    log = log if lead else (lambda *_: None)
    s = setup(config, log=log)
    plan, mesh, cfg, state, meta = s.plan, s.mesh, s.plan.model, s.state, s.meta
    opts = plan.options
    t = opts.train
    log(partition_table(state["params"], s.optimizer, s.tx))

    ckpt = checkpoint_manager(t, workdir)
    closers.append(ckpt.close)
    data_state, start = None, 0
    latest = ckpt.latest_step()
    # a run already past train.steps does nothing, so its record keeps what it was trained with
    run_record.ensure(config, workdir, resuming=latest is not None,
                      write=lead and (latest is None or latest < plan.steps), log=log)
    if latest is not None:
        restored = ckpt.restore(abstract_like(state), expect_meta=meta, log=log, set_aside=True)
        state, data_state, start = restored.state, restored.data, restored.step
        log(f"resumed from {ckpt.directory} step {start}")
    elif t.init_from:  # a previous run or a Hugging Face directory
        state = initialize_from(t.init_from, state, cfg, log=log)

    if start >= plan.steps:
        log(f"{workdir}: already trained to step {start} of {plan.steps}; nothing to do "
            f"(raise --config.train.steps to continue)")
        ckpt.close()
        return {"step": start}
    reserve_start = time.perf_counter()
    if reserved := ckpt.reserve_transfer_memory(state):
        log(f"pinned {reserved / 2**30:.1f} GiB of host memory for checkpoint copies in "
            f"{time.perf_counter() - reserve_start:.1f} s")
    batch_sharding = s.program.batch_sharding  # [k microbatches, rows, ...]; rows split over data (step_options.py)
    it = train_iterator(s.train_sources, opts.data.weights, seq_len=plan.seq_len, global_batch=plan.micro_rows,
                        seed=opts.seed, rank=jax.process_index(), num_ranks=jax.process_count(), state=data_state,
                        prefetch=opts.data.prefetch, vocab_size=cfg.vocab_size)
    closers.append(it.close)
    reset = opts.data.reset_at_documents
    step_fn = s.program.step  # the state's shardings pinned on its outputs, the state donated (train/program.py)
    evaluator = Evaluator(s.graphdef, s.valid_sources, seq_len=plan.seq_len, rows=plan.micro_rows, mesh=mesh,
                          max_batches=t.eval_batches, reset_at_documents=reset)
    if t.eval_every and not evaluator.names:
        log("no held-out sources (data.valid_sources): evaluation is off")
    writer = MetricsWriter(workdir, enabled=lead, resume_step=start)  # drops rows logged past start before
    closers.append(writer.close)
    if writer.dropped:
        log(f"metrics.jsonl: dropped {writer.dropped} rows logged past step {start} by an earlier attempt")
    peak = _peak_flops(t)
    flops_tok = flops_per_token(cfg, plan.seq_len)
    tokens_per_micro = plan.micro_rows * plan.seq_len  # throughput counts tokens, so a ramp is measured right
    meter, last = Throughput(), {}
    progress = _progress(start, plan.steps, lead)
    closers.append(getattr(progress, "close", lambda: None))  # a bar left open redraws after the error
    sums, step_count = {}, 0
    faults = FaultInjector(t.fault, workdir)
    stop = GracefulStop()
    skip_windows = read_control(workdir)["skip_steps"]
    for step in range(start, plan.steps):
        done = step + 1
        k = plan.accumulation_at(step)
        microbatches = [next(it) for _ in range(k)]  # the data iterator's state moves on by whole steps
        if skipped(done, skip_windows):  # data the supervisor marked bad (NaN / loss spike): read past it
            # the step counts as done, unchanged: its heartbeat, evaluation and checkpoint (the final one
            # included) still come below
            log(f"step {done}: skipping its data (supervisor rewind)")
        else:
            state, m = step_fn(state, stacked_on_devices(microbatches, batch_sharding))
            faults.after_dispatch(done)
            for name, v in m.items():
                sums[name] = sums.get(name, 0.0) + v
            step_count += 1
            meter.add(k * tokens_per_micro)
            if faults.poisoned("nan", done):  # what a poisoned batch does: non-finite weights and loss
                state = {**state, "params": jax.tree.map(lambda p: p * jnp.nan, state["params"])}
                sums["loss"] = sums["loss"] * jnp.nan
            if faults.poisoned("spike", done):
                sums["loss"] = sums["loss"] * 50.0
            if not meter.started:  # the first step run (skipped data may come first) compiles: not measured
                jax.block_until_ready(state)
                meter.start()
            if done % t.log_every == 0 or done == plan.steps:
                last = routing_metrics.flatten({name: np.asarray(v) / step_count for name, v in sums.items()})
                sums, step_count = {}, 0
                tps = meter.rate()
                if tps is not None:  # a row of only the compiling step (the first after a start or resume) has none
                    last["tokens_per_s"] = tps
                    if peak:
                        last["mfu"] = tps * flops_tok / (peak * jax.device_count())
                last.update({f"lr_{k}": float(v) for k, v in learning_rates(state["opt_state"]).items()})
                writer.write(done, last)
                progress(done, last)
                if not math.isfinite(last["loss"]):
                    log(f"step {done}: loss is {last['loss']}; stopping without saving (exit {EXIT_NONFINITE})")
                    writer.close()
                    ckpt.wait()  # an earlier, good checkpoint may still be writing: finish it, it is the rewind point
                    os._exit(EXIT_NONFINITE)  # no checkpoint of a broken state; the supervisor rewinds
        if lead:
            beat(workdir, done, warm=meter.started)  # started: a step has run (compiled) here
        faults.after_step(done)
        if stop.requested:
            log(f"step {done}: stop requested; finishing checkpoint writes (exit {EXIT_STOPPED})")
            writer.close()
            ckpt.wait()
            os._exit(EXIT_STOPPED)
        if t.eval_every and evaluator.names and (done % t.eval_every == 0 or done == plan.steps):
            jax.block_until_ready(state)  # the step's own compute stays in the step time
            with meter.excluded():  # evaluation (and its first call's compilation) is not training throughput
                ev = evaluator(state["params"], state["model_state"])
            writer.write(done, ev)
            log(f"eval @ {done}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()))
            last.update(ev)
        if done % t.checkpoint_every == 0 or done == plan.steps:
            jax.block_until_ready(state)
            # what a save costs the loop: the device->host copy and any wait for the previous save to finish
            with meter.excluded() as blocked:
                saved = ckpt.save(done, state, data=it.state(), meta=meta, force=done == plan.steps)
            if saved:
                writer.write(done, {"checkpoint_blocking_s": blocked.seconds})
            faults.after_save(done)
    if lead:
        beat(workdir, plan.steps, finishing=True)
    it.close()
    ckpt.close()
    writer.close()
    return last


def stacked_on_devices(microbatches: list[dict], sharding: NamedSharding) -> dict:
    """One optimizer step's host microbatches (this process's rows) as global arrays [k, rows, ...], put on the
    devices in one transfer per field."""
    return {name: jax.make_array_from_process_local_data(sharding, np.stack([m[name] for m in microbatches]))
            for name in microbatches[0]}


class GracefulStop:
    """SIGTERM sets a flag the loop checks after each step, instead of killing a checkpoint write halfway."""

    def __init__(self):
        self.requested = False
        try:
            signal.signal(signal.SIGTERM, self._request)
        except ValueError:  # not the main thread (e.g. a test harness): keep the default behaviour
            pass

    def _request(self, *_):
        self.requested = True


def _peak_flops(train: TrainOptions) -> float | None:
    if train.peak_tflops:
        return train.peak_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for name, tf in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tf * 1e12
    return None


def _progress(start: int, total: int, enabled: bool):
    if not enabled:
        return lambda *_: None
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0)
    t0 = [time.perf_counter(), start]

    def update(done, m):
        bar.update(done - t0[1])
        t0[1] = done
        shown = {"loss": f"{m['loss']:.4f}", "tok/s": f"{m['tokens_per_s']:.0f}" if "tokens_per_s" in m else "-"}
        if "max_load" in m:  # the worst layer's expert loads relative to uniform
            shown["load"] = f"{m['max_load']:.2f}/{m['min_load']:.2f}"
        if m.get("moved"):  # tokens that equal shares moved: how far the solve left the experts from balance
            shown["moved"] = f"{100 * m['moved']:.1f}%"
        if "mfu" in m:
            shown["mfu"] = f"{100 * m['mfu']:.1f}%"
        bar.set_postfix(shown)
        if done == total:
            bar.close()

    update.close = bar.close
    return update

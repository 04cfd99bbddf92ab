"""The trainer end to end on a very small model: exact resume (same losses bitwise, same data order), gradient
accumulation equal to a larger batch, the next phase from the previous weights on another mesh, chunked head
cross-entropy, the trainer's side of the supervisor's contract (skipped data, injected spike and NaN, heartbeat).
Resuming on fewer devices: tests/test_parallel_train.py (8 -> 4, 1 x 2 context, 1)."""

import json
import re
import os
import shutil

import jax
import numpy as np
import pytest

from configs.default import get_config
from zaya_jax.fault.control import CONTROL, HEARTBEAT, read_json, write_json_atomic
from zaya_jax.train.loop import EXIT_NONFINITE, TrainConfigError, run


def small_config(**train):
    c = get_config()
    c.model.overrides.update(dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, moe_intermediate_size=64, num_experts=4, router_hidden_size=16,
                                  remat="none"))
    c.data.seq_len = 32
    c.data.prefetch = 0
    c.train.update(dict(steps=6, global_batch_tokens=8 * 32, microbatch_tokens=8 * 32, log_every=1, eval_every=0,
                        checkpoint_every=3))
    c.train.update(train)
    c.mesh.num_devices = 4
    # fp32 Newton-Schulz: exact comparisons here, and the same programs as tests/test_parallel_train.py's (which
    # compares to 1e-5): its resume on 4 devices and the 4-device runs here share one compilation
    c.optim.update(dict(warmup_steps=2, total_steps=6, muon_ns_dtype="float32"))
    # routers select with the stored biases alone: the in-microbatch balancing solve (on when the controller is)
    # routes by each rank's microbatch, so runs split differently over devices or microbatches would route
    # differently, and these tests compare such runs exactly (the controller: tests/test_balancing.py)
    c.balancing.learning_rate = 0.0
    return c


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stopped_after(workdir, dest, step):
    """A copy of run `workdir` as if it had stopped after `step`: later checkpoints and the metrics log dropped."""
    shutil.copytree(workdir, dest)
    ckpts = os.path.join(dest, "checkpoints")
    for name in os.listdir(ckpts):
        if name.isdigit() and int(name) > step:
            shutil.rmtree(os.path.join(ckpts, name))
    os.remove(os.path.join(dest, "metrics.jsonl"))
    return dest


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 6-step run (a checkpoint after every step, all kept) and its losses, which the other runs
    here compare to or start from."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    run(small_config(checkpoint_every=1, keep_checkpoints=STEPS), workdir, log=lambda *_: None)
    return workdir, losses(workdir)


STEPS = 6  # small_config's


def test_resume_is_exact(straight, tmp_path):
    workdir, full = straight
    # the run as if stopped after step 3 (the state a run of steps=3 saves: the same program and data; changing
    # train.steps on a resume: tests/test_run_lifecycle.py and the unreadable-step test below)
    stopped = stopped_after(workdir, str(tmp_path / "stopped"), 3)
    run(small_config(), stopped, log=lambda *_: None)  # resumes after the step-3 checkpoint
    resumed = losses(stopped)
    assert sorted(resumed) == [4, 5, 6]
    for s in range(4, 7):
        assert resumed[s] == full[s], (s, resumed[s], full[s])  # bitwise on the CPU


def test_gradient_accumulation_equals_a_larger_batch(straight, tmp_path):
    import orbax.checkpoint as ocp

    def params_at_step_1(wd):
        mngr = ocp.CheckpointManager(os.path.join(wd, "checkpoints"))
        return mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]

    one = params_at_step_1(straight[0])  # one microbatch of 8 x 32 tokens per step
    wd = str(tmp_path / "accumulated")
    # two microbatches of 4 x 32; the biases do not move between microbatches (balancing off in small_config)
    run(small_config(steps=1, checkpoint_every=1, microbatch_tokens=4 * 32), wd, log=lambda *_: None)
    accumulated = params_at_step_1(wd)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(accumulated)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_init_from_takes_a_runs_latest_step_or_the_step_whose_folder_is_named(straight, tmp_path):
    from zaya_jax.checkpoint.manager import CheckpointError, restore_subset
    from zaya_jax.inference.loading import orbax_directory, step_folder
    first, _ = straight
    checkpoints = os.path.join(first, "checkpoints")
    for run_or_checkpoints in (first, checkpoints):  # the latest step of the checkpoints folder
        assert step_folder(run_or_checkpoints) is None and orbax_directory(run_or_checkpoints) == checkpoints
    assert step_folder(os.path.join(checkpoints, "4")) == (os.path.abspath(checkpoints), 4)
    unfinished = tmp_path / "copy" / "checkpoints" / "9"  # a step folder whose save never finished
    shutil.copytree(first, tmp_path / "copy")
    unfinished.mkdir()
    c = small_config(steps=1)
    with pytest.raises(CheckpointError, match=re.escape(f"no finished checkpoint for step 99 in {checkpoints} (have "
                                                        "[1, 2, 3, 4, 5, 6])")):
        restore_subset(checkpoints, {}, step=99)
    for source, said in ((unfinished, "checkpoints step 9 cannot be read ("),
                         (os.path.join(checkpoints, "9"), ": no such directory (a run, one of its checkpoint steps, ")):
        c.train.init_from = str(source)
        with pytest.raises((CheckpointError, TrainConfigError), match=re.escape(said)):
            run(c, str(tmp_path / "refused"), log=lambda *_: None)


def test_next_phase_starts_from_the_previous_weights_on_another_mesh(straight, tmp_path):
    import orbax.checkpoint as ocp
    first, _ = straight  # phase A: a checkpoint after each of its 6 steps; this phase starts from step 4's
    c = small_config(steps=1, checkpoint_every=1)
    c.train.init_from = os.path.join(first, "checkpoints", "4")
    c.mesh.num_devices = 2
    c.model.overrides.rope = {"hybrid": {"theta": 1e6, "partial_rotary_factor": 0.5}}  # phase-3 style change
    c.optim.learning_rate = 0.0  # so the saved weights must equal phase A's
    second = str(tmp_path / "phase_b")
    run(c, second, log=lambda *_: None)
    read = lambda d, s: ocp.CheckpointManager(os.path.join(d, "checkpoints")).restore(  # noqa: E731
        s, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    a, b = read(first, 4), read(second, 1)
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # the chunked loss and its gradients equal the full head's: tests/test_chunked_loss.py
def test_chunked_head_cross_entropy_trains_like_the_full_logits(straight, tmp_path):
    _, a = straight  # full logits
    c = small_config(steps=3)
    c.train.ce_chunk_tokens = 48  # does not divide the 8 x 32 tokens of a microbatch
    chunked = str(tmp_path / "chunked")
    run(c, chunked, log=lambda *_: None)
    b = losses(chunked)
    np.testing.assert_allclose([b[s] for s in (1, 2, 3)], [a[s] for s in (1, 2, 3)], rtol=2e-5)


class Exited(Exception):
    pass


def test_the_trainer_skips_marked_data_reports_a_spike_and_exits_on_nan(straight, tmp_path, monkeypatch):
    """What the supervisor relies on (zaya_jax/fault/supervisor.py), in this process: os._exit raises instead of
    ending it. The real process under the supervisor: tests/test_fault_tolerance.py (slow)."""
    _, full = straight
    wd = str(tmp_path / "faults")
    os.makedirs(wd)
    write_json_atomic(os.path.join(wd, CONTROL), {"skip_steps": [[2, 2]]})  # as a rewind leaves it

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)
    said = []
    with pytest.raises(Exited) as exited:  # the straight run's program: the compilation cache has it
        run(small_config(steps=4, fault="spike@3,nan@4"), wd, log=lambda line, *_: said.append(str(line)))
    assert exited.value.args == (EXIT_NONFINITE,)
    assert "step 2: skipping its data (supervisor rewind)" in said
    got = losses(wd)
    assert sorted(got) == [1, 3, 4] and got[1] == full[1]
    assert got[3] > 10 * full[3] and np.isnan(got[4])  # the spike is in the logged loss only; NaN is logged
    # no checkpoint of the NaN state; the step-3 one finished, and its data position is past the skipped step's
    import orbax.checkpoint as ocp
    read = lambda d: ocp.CheckpointManager(os.path.join(d, "checkpoints")).restore(  # noqa: E731
        3, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert sorted(int(n) for n in os.listdir(os.path.join(wd, "checkpoints")) if n.isdigit()) == [3]
    assert read(wd) == read(straight[0])
    beat = read_json(os.path.join(wd, HEARTBEAT))
    assert (beat["step"], beat["finishing"], beat["pid"]) == (3, False, os.getpid())


def tensorboard_purge_steps(workdir):
    """Steps of the SessionLog START events (TensorBoard hides earlier events at or past them) per event file."""
    import glob
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog
    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
        data, pos, starts = open(path, "rb").read(), 0, []
        while pos < len(data):  # TFRecord: length, its crc, the record, its crc
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                starts.append(event.step)
            pos += 16 + n
        out.append(starts)
    return out


def test_resume_past_an_unreadable_step_keeps_good_state_and_logs_every_step_once(tmp_path, monkeypatch):
    """An unreadable latest checkpoint is set aside (saves after the fallback happen, retention keeps them); rows
    logged past the restored step go; throughput is measured after a rewind's skipped step; every save logs its
    blocking time; a failure after metrics started leaves no TensorBoard thread behind."""
    import threading

    import orbax.checkpoint as ocp

    from zaya_jax.train import loop
    wd = str(tmp_path / "run")
    def cfg(steps, total_steps=6):
        # total_steps 6 (small_config's): the straight run's program, which the compilation cache holds
        c = small_config(steps=steps, checkpoint_every=2, keep_checkpoints=2)
        c.optim.total_steps = total_steps
        return c

    run(cfg(4), wd, log=lambda *_: None)  # checkpoints 2 and 4, rows 1-4
    for root, _, files in os.walk(os.path.join(wd, "checkpoints", "4", "state")):
        for f in files:
            open(os.path.join(root, f), "wb").close()
    write_json_atomic(os.path.join(wd, CONTROL), {"skip_steps": [[3, 3]]})  # as a supervisor rewind leaves it
    said = []
    run(cfg(6), wd, log=lambda line, *_: said.append(str(line)))  # falls back to 2, skips 3, trains 4-6
    assert any(f"moved to {os.path.join(wd, 'checkpoints', 'unreadable', '4')}" in line for line in said), said
    ckpts = ocp.CheckpointManager(os.path.join(wd, "checkpoints"))
    assert ckpts.all_steps() == [4, 6]  # the step-4 save happened; retention dropped 2, the oldest readable
    ckpts.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore()))  # readable
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 4, 5, 6]
    from zaya_jax.fault.drill import read_attempts  # metrics.attempts.jsonl keeps what each attempt logged
    assert [sorted(a) for a in read_attempts(wd)] == [[1, 2, 3, 4], [4, 5, 6]]
    # the first row of each attempt timed only its compiling step: no figure rather than 0
    assert [r["step"] for r in trained if "tokens_per_s" not in r] == [1, 4]
    assert all(r["tokens_per_s"] > 0 for r in trained if r["step"] in (2, 5, 6))
    assert [r["step"] for r in rows if "checkpoint_blocking_s" in r] == [2, 4, 6]
    assert all(0 <= r["checkpoint_blocking_s"] < 60 for r in rows if "checkpoint_blocking_s" in r)
    assert tensorboard_purge_steps(wd) == [[1], [3]]  # the second attempt hides what the first logged past 2

    def tensorboard_threads():
        return [t for t in threading.enumerate() if type(t).__name__ == "_EventLoggerThread"]

    def fail(workdir):  # the loop's last call before its first step: metrics (TensorBoard's thread) have started
        assert tensorboard_threads(), "control: the writer's thread runs when the failure comes"
        raise RuntimeError("disk full")

    monkeypatch.setattr(loop, "read_control", fail)
    with pytest.raises(RuntimeError, match="disk full"):  # total_steps 0: the schedule follows train.steps = 8
        run(cfg(8, total_steps=0), wd, log=lambda *_: None)
    assert not tensorboard_threads()

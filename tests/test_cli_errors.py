"""A user's mistake on the command line ends in one line naming it and a non-zero exit, never a traceback; values
that cannot work are refused before a model is built; the supervisor shows its options and says why it stopped."""

import os
import re
import subprocess
import sys

import jax
import pytest

from configs.default import get_config
from benchmarks import characterize, size_model
from launch import convert_hf, evaluate_lm, generate, prepare_data, routing, supervise
from launch._cli import EXIT_INTERRUPTED, EXIT_USER_ERROR, user_errors
from zaya_jax.fault.supervisor import Supervisor, SupervisorConfig
from zaya_jax.train import loop
from zaya_jax.train.loop import TrainConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_line_exit(capsys, main, argv, *words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USER_ERROR, (e.value.code, err)
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err


@pytest.mark.parametrize("key,value,named", [
    ("train.steps", 0, "train.steps=0"), ("train.log_every", 0, "train.log_every=0"),
    ("train.checkpoint_every", -5, "train.checkpoint_every=-5"), ("train.eval_every", -1, "train.eval_every=-1"),
    ("train.global_batch_tokens", 0, "train.global_batch_tokens=0"), ("data.seq_len", 0, "data.seq_len=0"),
    ("optim.learning_rate", -1e-3, "optim.learning_rate=-0.001"),
    ("optim.learning_rate", float("nan"), "optim.learning_rate=nan"),
    ("optim.total_steps", -1, "optim.total_steps=-1"), ("optim.schedule", "cosin", "'cosin'"),
    ("balancing.learning_rate", -1.0, "balancing.learning_rate=-1.0"),
    # the default warmup (20 steps) and cooldown (0.3 of the steps) leave no room in 25 steps
    ("train.steps", 25, "set --config.train.steps=28 or more")])
def test_values_that_cannot_work_are_refused_before_a_model_is_built(key, value, named, tmp_path, monkeypatch):
    def built(*_, **__):
        raise AssertionError("a model was built")

    monkeypatch.setattr(loop, "build_train_program", built)
    c = get_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(TrainConfigError, match=named.replace(".", r"\.")):
        loop.run(c, str(tmp_path), log=lambda *_: None)


def test_a_run_directory_that_would_mix_with_other_data_is_refused(tmp_path, monkeypatch):
    """A file, a folder inside another run (its checkpoint step, a new folder in its checkpoints/, its tokenizer), a
    Hugging Face directory: refused in one line before a model is built, nothing written."""
    def built(*_, **__):
        raise AssertionError("a model was built")

    monkeypatch.setattr(loop, "build_train_program", built)
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "run.json").write_text("{}\n")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}\n")
    (hf / "model.safetensors").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    cases = [(tmp_path / "notes.txt", "is a file, not a directory"),
             (run / "checkpoints" / "10", f"is inside the training run {run}: use a directory outside it"),
             (run / "checkpoints" / "20", f"is inside the training run {run}"),
             (run / "tokenizer", f"is inside the training run {run}"),
             (hf, f"is a Hugging Face directory (config.json, model.safetensors): train in another directory, "
                  f"starting from it with --config.train.init_from={hf}")]
    before = sorted(map(str, tmp_path.rglob("*")))
    for workdir, said in cases:
        with pytest.raises(TrainConfigError) as e:
            loop.run(get_config(), str(workdir), log=lambda *_: None)
        assert str(e.value).startswith(f"run directory {workdir} {said}"), str(e.value)
    assert sorted(map(str, tmp_path.rglob("*"))) == before


def test_a_train_state_larger_than_the_machine_is_refused_before_it_exists(tmp_path, monkeypatch):
    """The 8B config on a small CPU machine: refused in one line on the state's abstract shapes (the default run's
    state against a machine of 1 MiB here), not swapped or killed by the OS."""
    from zaya_jax.train import program, state_memory

    def created(*_, **__):
        raise AssertionError("the state was created")

    monkeypatch.setattr(state_memory, "host_available_bytes", lambda: 2 ** 20)
    monkeypatch.setattr(program.jax, "jit", created)
    with pytest.raises(TrainConfigError, match=r"^the train state needs 0\.[0-9] GiB \(parameters 0\.[0-9] GiB, the "
                                               r"rest optimizer state\) but this machine's available memory is "
                                               r"0\.0 GiB: "):
        loop.run(get_config(), str(tmp_path), log=lambda *_: None)
    monkeypatch.undo()
    assert state_memory.host_available_bytes() > 2 ** 20  # the real probe reads this machine's /proc/meminfo


def test_a_step_that_does_not_fit_in_memory_is_named(tmp_path, monkeypatch):
    def oom(*_, **__):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 814477511424 bytes.\nmore")

    monkeypatch.setattr(loop, "_run", oom)
    with pytest.raises(TrainConfigError, match=r"does not fit in device memory \(RESOURCE_EXHAUSTED: Out of memory "
                                               r"allocating 814477511424 bytes.\): lower train.microbatch_tokens"):
        loop.run(get_config(), str(tmp_path), log=lambda *_: None)


def test_argparse_commands_report_mistakes_in_one_line(tmp_path, capsys, monkeypatch):
    # lm_eval indexes its built-in tasks from the folder of lm_eval/tasks/manager.py: here the toy task's folder,
    # so the unknown-task check below looks a name up in a full (include_defaults) index without parsing lm_eval's
    # thousands of task files (about a minute on 2 cores)
    from lm_eval.tasks import manager
    monkeypatch.setattr(manager, "__file__", os.path.join(ROOT, "tests", "data", "lm_eval_toy", "manager.py"))
    assert manager.TaskManager().all_tasks == ["zaya_toy_mc"]  # control: the defaults are the toy folder's
    one_line_exit(capsys, generate.main, ["--checkpoint", str(tmp_path), "--prompt", "a", "--temperature", "nan"],
                  "launch.generate", "temperature")
    one_line_exit(capsys, size_model.main, ["--hardware", "h300"], "benchmarks.size_model", "h300")
    one_line_exit(capsys, size_model.main, ["--model", "zaya9"], "benchmarks.size_model", "zaya9")
    one_line_exit(capsys, prepare_data.main, ["x.txt", "--holdout-every", "two"], "launch.prepare_data", "two")
    one_line_exit(capsys, characterize.main, ["gemm", "--model", "zaya9", "--out", str(tmp_path)],
                  "benchmarks.characterize", "zaya9")
    one_line_exit(capsys, supervise.main, ["--max-restarts", "1"], "launch.supervise", "after --")
    one_line_exit(capsys, generate.main, ["--checkpoint", str(tmp_path), "--prompt", "a", "--max-new-tokens", "0"],
                  "launch.generate", "--max-new-tokens")
    one_line_exit(capsys, evaluate_lm.main, ["--checkpoint", str(tmp_path), "--tasks", "no_such_task"],
                  "launch.evaluate_lm", "unknown task no_such_task")
    one_line_exit(capsys, evaluate_lm.main, ["--checkpoint", str(tmp_path), "--tasks", "zaya_toy_mc",
                                             "--include-path", str(tmp_path / "nope")],
                  "launch.evaluate_lm", "--include-path", "is not a directory")
    one_line_exit(capsys, evaluate_lm.main, ["--checkpoint", str(tmp_path), "--tasks", "zaya_toy_mc", "--output",
                                             str(tmp_path)], "launch.evaluate_lm",
                  f"--output {tmp_path} is a directory")
    (tmp_path / "file").write_text("")  # a results file below a file: its folder cannot be created
    one_line_exit(capsys, evaluate_lm.main, ["--checkpoint", str(tmp_path), "--tasks", "zaya_toy_mc", "--samples",
                                             str(tmp_path / "file" / "s.jsonl")], "launch.evaluate_lm",
                  "--samples", "its folder cannot be created")
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "routing/max_load/layer_00": 1.0}}\n'
                                                    for s in (10, 20, 30)))
    one_line_exit(capsys, routing.main, [str(tmp_path), "--step", "7"], "launch.routing", "at step 7",
                  "3 logged steps, from 10 to 30")


def test_ctrl_c_ends_a_command_in_one_line(capsys):
    @user_errors("launch.x")
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        interrupted()
    assert e.value.code == EXIT_INTERRUPTED and capsys.readouterr().err.strip() == "launch.x: interrupted"


@pytest.mark.parametrize("argv,words", [
    (["--config", "configs/nope.py"], ["launch.train", "nope.py"]),
    (["--config.train.stepz=3"], ["launch.train", "--config.train.stepz=3: the config has no field 'train.stepz'"]),
    (["--config.model.num_experts=4"], ["no field 'model.num_experts'", "--config.model.overrides.FIELD"]),
    (["--config.train.steps=0", "--workdir", "{tmp}"], ["launch.train", "train.steps=0"]),
    (["--config.mesh.context=3", "--workdir", "{tmp}"], ["launch.train", "context=3 must divide"])])
def test_train_reports_a_missing_config_a_bad_flag_and_a_bad_value_in_one_line(argv, words, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "launch.train", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == EXIT_USER_ERROR, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), p.stderr


def test_a_damaged_run_record_is_named_in_one_line(tmp_path, capsys):
    """run.json cut short: the resume, the export and the library's reader name the file (not 'bad command line', not
    a JSONDecodeError traceback); a JSON file that is no run record likewise."""
    from zaya_jax.train import run_record
    (tmp_path / "run.json").write_text('{"config": {"model"')
    (tmp_path / "checkpoints").mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "launch.train", "--workdir", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == EXIT_USER_ERROR and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"launch.train: {tmp_path / 'run.json'} is damaged (Expecting "), lines[0]
    with pytest.raises(SystemExit, match=re.escape(f"convert_hf: {tmp_path / 'run.json'} is damaged (Expecting ")):
        convert_hf.main([str(tmp_path), "--export", str(tmp_path.parent / "export")])
    (tmp_path / "run.json").write_text('["not", "a", "record"]')
    with pytest.raises(TrainConfigError, match="is not a run record"):
        run_record.read(str(tmp_path))


def test_supervise_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        supervise.main(["--help"])
    assert e.value.code == 0 and "--max-restarts" in capsys.readouterr().out


@pytest.mark.parametrize("max_restarts,said", [(0, "gave up after 0 restarts"), (5, "the same failure twice")])
def test_the_supervisor_says_why_it_stopped(max_restarts, said, tmp_path, capsys):
    cfg = SupervisorConfig(workdir=str(tmp_path), command=[sys.executable, "-c", "raise SystemExit(2)"],
                           max_restarts=max_restarts, backoff_s=0.01, poll_s=0.02)
    assert Supervisor(cfg).run() != 0
    err = capsys.readouterr().err
    assert said in err and "crash (exit 2) before the first step" in err, err

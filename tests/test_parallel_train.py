"""The trainer under parallelism, 8 emulated CPU devices: ZeRO-1 and context-parallel (CP = 2, ring) training equal
the replicated run; a ZeRO-1-sharded checkpoint saved on 8 devices resumes on 4, on 1 x 2 (context parallel, all-gather
attention) and on 1 with the losses of the uninterrupted run (the devices named by ZAYA_NUM_DEVICES, as the supervisor
restarts a trainer on the devices left); 2 processes x 4 devices (jax.distributed) train as 1 process x 8 (marked
slow: two trainer processes compiling, ~50 s on 2 cores; the default run checks 2 processes joining one job and
reducing over nodes and rails in tests/test_parallel_distributed.py).

A one-process run trains in this process on the first N of its 8 emulated devices (as tests/test_train.py does);
the 2-process run starts its processes (`python tests/test_parallel_train.py RUN.json`), which compile with LLVM
optimisation off like this one (these programs run a few steps; compile time dominates) and share its compilation
cache.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

STEPS = 4


def _config(spec: dict):
    from ml_collections import ConfigDict
    from test_train import small_config
    c = small_config(steps=spec.get("steps", STEPS), checkpoint_every=2)  # fp32 Newton-Schulz: compared to 1e-5
    c.train.keep_checkpoints = 4
    c.mesh.num_devices = spec.get("devices", 0)
    c.mesh.context = spec.get("context", 1)
    c.parallel = ConfigDict(dict(zero1=spec.get("zero1", True), context_attention=spec.get("attention", "ring")))
    return c


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
               JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(__file__), "..", ".jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")])
    return env


def train(workdir: str, **spec) -> tuple[dict[int, float], list[str]]:
    """Runs the trainer (spec: devices, context, zero1, attention, steps, processes) and returns the losses it logged
    for the steps it trained, and each process's output (one process: its log lines)."""
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    processes = spec.get("processes", 1)
    if processes == 1:
        from zaya_jax.train.loop import run
        lines = []
        run(_config(spec), workdir, log=lambda line, *_: lines.append(str(line)))
        outs = ["\n".join(lines)]
    else:
        devices_each = spec.get("devices_per_process", 8)
        run_spec = json.dumps(dict(spec, workdir=workdir))
        env = _env(devices_each)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(ZAYA_NUM_PROCESSES=str(processes), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
        procs = [subprocess.Popen([sys.executable, __file__, run_spec], env=dict(env, ZAYA_PROCESS_ID=str(i)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(processes)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-4000:]
    with open(metrics) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}, outs


def _close(a: dict, b: dict, steps):
    np.testing.assert_allclose([a[s] for s in steps], [b[s] for s in steps], rtol=1e-5)


@pytest.fixture(scope="module")
def zero1_run(tmp_path_factory):
    """ZeRO-1 on 8 devices, checkpoints at steps 2 and 4: the reference for every other run here."""
    workdir = str(tmp_path_factory.mktemp("zero1_8"))
    losses, outs = train(workdir, devices=8)
    assert "ZeRO-1 over ('data',), 8 shards" in outs[0], outs[0]
    return workdir, losses


@pytest.mark.slow  # its parts by default: test_parallel_zero1, test_parallel_context, test_train_accumulation
def test_zero1_and_context_parallel_train_like_the_replicated_run(zero1_run, tmp_path):
    _, reference = zero1_run
    assert sorted(reference) == list(range(1, STEPS + 1))
    replicated, outs = train(str(tmp_path / "replicated"), devices=8, zero1=False, steps=2)
    assert "(replicated)" in outs[0]
    _close(replicated, reference, [1, 2])
    context, outs = train(str(tmp_path / "cp2"), devices=8, context=2, attention="ring", steps=2)
    assert "mesh (data=4, expert=1, tensor=1, context=2)" in outs[0]
    assert "ZeRO-1 over ('data', 'context'), 8 shards" in outs[0]
    _close(context, reference, [1, 2])


# devices x context: 1 x 2 is the pure-context layout, ZeRO-1 over 'context' only, whose gradient reduction must not
# leave the gradients varying over the (size-1) node axis (it failed once); context 4 and 8: the model's CP gradients
# in tests/test_parallel_context.py
# slow (a restore onto another mesh by default: test_train.py's next phase); 8 devices onto 2 with context
# parallelism is the case that changes both the mesh's shape and its axes
@pytest.mark.slow
@pytest.mark.parametrize("devices, context", [pytest.param(4, 1, id="4"), pytest.param(2, 2, id="1x2_context"),
                                              pytest.param(1, 1, id="1")])
def test_zero1_checkpoint_from_8_devices_resumes_on_fewer(zero1_run, tmp_path, monkeypatch, devices, context):
    workdir, reference = zero1_run
    resumed = str(tmp_path / f"on{devices}")
    shutil.copytree(workdir, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", str(STEPS)))  # as if it had stopped after step 2
    # the config still says 8: the devices left come from the supervisor's variable, as after a restart
    monkeypatch.setenv("ZAYA_NUM_DEVICES", str(devices))
    losses, outs = train(resumed, devices=8, context=context, attention="allgather")
    assert f"resumed from {os.path.join(resumed, 'checkpoints')} step 2" in outs[0]
    assert f"mesh (data={devices // context}, expert=1, tensor=1, context={context})" in outs[0]
    if devices > 1:
        axes = "'data'," if context == 1 else "'context',"
        assert f"ZeRO-1 over ({axes}), {devices} shards" in outs[0], outs[0]
    assert sorted(losses) == [3, 4]
    _close(losses, reference, [3, 4])


@pytest.mark.slow
def test_two_processes_of_four_devices_train_like_one_process_of_eight(zero1_run, tmp_path):
    _, reference = zero1_run
    losses, outs = train(str(tmp_path / "two_processes"), processes=2, devices_per_process=4, steps=2)
    for i, out in enumerate(outs):
        assert f"process {i} of 2, 4 local of 8 devices" in out, out[-2000:]
    assert "on 2 node(s) x 4" in outs[0]
    _close(losses, reference, [1, 2])


if __name__ == "__main__":  # one training run (or one process of it), as `train` starts it
    spec = json.loads(sys.argv[1])
    import jax

    from zaya_jax.train.loop import run

    def log(line, *_):  # the layout, optimizer-state and resume lines the tests read
        if str(line).startswith(("mesh ", "  node ", "optimizer state", "resumed from")):
            print(line, flush=True)

    run(_config(spec), spec["workdir"], log=log)
    print(f"process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} local of "
          f"{jax.device_count()} devices", flush=True)

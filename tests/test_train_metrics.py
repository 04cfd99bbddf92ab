"""The metrics file after a resume (rows past the restored step dropped; the supervisor reads on after the file
shrank) and the throughput meter (evaluation and checkpoint time left out)."""

import json

from zaya_jax.fault.supervisor import Supervisor, SupervisorConfig
from zaya_jax.train import metrics
from zaya_jax.train.metrics import Throughput, drop_rows_after


def write_rows(path, steps, mode="a"):
    with open(path, mode) as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": float(s)}) + "\n")


def test_rows_past_the_restored_step_are_dropped_and_the_supervisor_reads_on(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [1, 2, 3, 4])
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    sup = Supervisor(SupervisorConfig(workdir=str(tmp_path), command=["true"]))
    rows, offset = sup._losses(0)
    assert [s for s, _ in rows] == [1, 2, 3, 4]
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)  # the restart resumes from step 2
    history = list(rows)
    offset = sup._restart_offset(history)
    assert history == rows[:2] and drop_rows_after(str(path), 2) == 0  # the trainer finds nothing left to drop
    write_rows(path, [3, 4, 5, 6])  # the restarted trainer's rows
    assert [s for s, _ in sup._losses(offset)[0]] == [3, 4, 5, 6]
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]
    assert drop_rows_after(str(path), 4) == 2
    assert sup._losses(10 ** 6) == ([], path.stat().st_size)  # the file shrank under the reader


def test_throughput_leaves_out_excluded_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    meter = Throughput()
    assert not meter.started
    meter.start()
    meter.add(1000)
    now[0] += 1.0  # a training step
    with meter.excluded() as evaluation:
        now[0] += 30.0  # evaluation's first call compiles
    meter.add(1000)
    now[0] += 1.0
    assert evaluation.seconds == 30.0 and meter.rate() == 1000.0
    meter.add(500)
    now[0] += 1.0
    assert meter.rate() == 500.0  # the next window starts clean

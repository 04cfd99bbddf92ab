"""A stand-in for `python -m launch.train` under the supervisor (tests/test_fault_supervisor.py): no jax, a step is a
short sleep. It keeps the trainer's side of the contract with the trainer's own code (zaya_jax/fault/control.py:
heartbeat, control file; zaya_jax/fault/inject.py: the fault kinds and their once-markers) and its order of work
per step (zaya_jax/train/loop.py): skip marked data (the step still counts: heartbeat and checkpoint), step, fault
after dispatch, log the mean loss of the steps since the last row every LOG_EVERY steps (non-finite: exit 65 without
saving), heartbeat, fault after the step, checkpoint. A NaN step poisons the weights: every later loss is NaN too,
and a checkpoint of a step no row judges holds them.

    python standin_trainer.py WORKDIR FAULTS STEPS CHECKPOINT_EVERY [LOG_EVERY]

Its "weights" are the list of data steps it trained on, saved in each checkpoint (written to a temporary name and
renamed when finished, as Orbax does; `killsave` kills it between the two) and logged, with the checkpoint it
resumed from and ZAYA_NUM_DEVICES, to WORKDIR/standin.jsonl at each start and at the end. A checkpoint step's
state is saved before its loss is logged, so the supervisor always finds it when it judges that loss.
"""

import json
import math
import os
import sys
import time

from zaya_jax.fault.control import beat, read_control, skipped
from zaya_jax.fault.inject import FaultInjector

EXIT_NONFINITE = 65
STEP_S = 0.05


def finished_checkpoints(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def log(workdir, **row):
    with open(os.path.join(workdir, "standin.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def main(workdir, faults, steps, every, log_every=1):
    os.makedirs(os.path.join(workdir, "checkpoints"), exist_ok=True)
    done = finished_checkpoints(workdir)
    start = done[-1] if done else 0
    trained = []
    if start:
        with open(os.path.join(workdir, "checkpoints", str(start), "state.json")) as f:
            trained = json.load(f)
    log(workdir, event="start", resumed_from=start, devices=os.environ.get("ZAYA_NUM_DEVICES"), pid=os.getpid())
    inject = FaultInjector(faults, workdir)
    skip = read_control(workdir)["skip_steps"]
    metrics = open(os.path.join(workdir, "metrics.jsonl"), "a")
    window, poisoned = [], False
    for step in range(start + 1, steps + 1):
        if not skipped(step, skip):
            time.sleep(STEP_S)
            inject.after_dispatch(step)
            trained.append(step)
            poisoned |= inject.poisoned("nan", step)
            loss = math.nan if poisoned else 3.0 / (1.0 + 0.1 * len(trained))
            if inject.poisoned("spike", step):
                loss *= 50.0
            window.append(loss)
        logs = bool(window) and (step % log_every == 0 or step == steps)
        if step % every == 0 or step == steps:  # saved before the loss is logged (see the docstring)
            tmp = os.path.join(workdir, "checkpoints", f"{step}.tmp-{os.getpid()}")
            if not (poisoned and logs):  # as the trainer: a NaN row stops it first; a step it does not log saves
                os.makedirs(tmp)
                with open(os.path.join(tmp, "state.json"), "w") as f:
                    json.dump(trained, f)
                inject.after_save(step)
                os.replace(tmp, os.path.join(workdir, "checkpoints", str(step)))
        if logs:
            mean = sum(window) / len(window)
            window = []
            metrics.write(json.dumps({"step": step, "loss": mean}) + "\n")
            metrics.flush()
            if not math.isfinite(mean):
                os._exit(EXIT_NONFINITE)
        beat(workdir, step)
        inject.after_step(step)
    beat(workdir, steps, finishing=True)
    log(workdir, event="end", trained=trained)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *map(int, sys.argv[5:6]))

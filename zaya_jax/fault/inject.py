"""Fault injection for the fault-tolerance tests and for drills on a real cluster.

train.fault = "KIND@STEP[,KIND@STEP...]" with KIND one of
  nan      the optimizer step STEP yields NaN parameters and loss (as a poisoned batch would): keyed on the
           step's data, so once the supervisor skips that data the fault is gone
  spike    the loss reported at STEP is multiplied by 50 (keyed on the data, like nan)
  crash    the process exits with status 3 after STEP (once)
  hang     the process stops making progress after STEP (once)
  kill     SIGKILL right after STEP's train step is dispatched, before it completes (once)
  killsave SIGKILL right after the asynchronous save of STEP starts (once)
"Once" faults leave a marker file in the run directory so the restarted process runs clean.
"""

from __future__ import annotations

import os
import signal
import time

KINDS = ("nan", "spike", "crash", "hang", "kill", "killsave")


def parse(spec: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        kind, _, step = part.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"train.fault entry {part!r}: expected KIND@STEP with KIND in {KINDS}")
        out.setdefault(kind, set()).add(int(step))
    return out


class FaultInjector:
    def __init__(self, spec: str, workdir: str):
        self.faults = parse(spec)
        self.workdir = workdir

    def _once(self, kind: str, step: int) -> bool:
        if step not in self.faults.get(kind, ()):
            return False
        marker = os.path.join(self.workdir, f".fault_{kind}_{step}")
        if os.path.exists(marker):
            return False
        open(marker, "w").close()
        return True

    def poisoned(self, kind: str, step: int) -> bool:
        return step in self.faults.get(kind, ())

    def after_dispatch(self, step: int):
        if self._once("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int):
        if self._once("crash", step):
            os._exit(3)
        if self._once("hang", step):
            while True:
                time.sleep(3600)

    def after_save(self, step: int):
        if self._once("killsave", step):
            os.kill(os.getpid(), signal.SIGKILL)

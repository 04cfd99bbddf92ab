"""Phase bookkeeping shared by both halves of benchmarks/bench_inference.py (standard library only: the HF half
imports no JAX and the JAX half no torch).

Every measurement is a named phase run under `Phases.run`: it is skipped when the process's deadline is too near,
an exception is recorded (type, message, traceback tail) instead of ending the process, and the whole result is
re-written to the process's JSON file (atomically) after each phase, so a process killed at its deadline still
leaves everything measured before. ZAYA_BENCH_FAIL=name1,name2 makes those phases raise, ZAYA_BENCH_HANG=name
makes one hang (to test partial output and the deadline).
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
import time
import traceback

FAIL_ENV = "ZAYA_BENCH_FAIL"
WATCHDOG_GRACE_S = 25
HANG_ENV = "ZAYA_BENCH_HANG"  # phases that sleep until the process is stopped (to test the deadline)


def write_json(path: str, data) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


class Phases:
    def __init__(self, out_path: str, deadline: float, prefix: str, only: list[str] | None = None):
        """only: fnmatch patterns of the measurement phases to run (None: all); the ones that set the model up
        (run with min_left_s=-inf) always run."""
        self.out_path, self.deadline, self.prefix, self.only = out_path, deadline, prefix, only
        self.data: dict = {"phases": {}}
        self.failing = {s.strip() for s in os.environ.get(FAIL_ENV, "").split(",") if s.strip()}
        self.hanging = {s.strip() for s in os.environ.get(HANG_ENV, "").split(",") if s.strip()}
        self.save()
        # the driver stops this process at its deadline; should the driver itself be gone, the process ends itself
        wait = max(0.0, deadline - time.time()) + WATCHDOG_GRACE_S
        if wait < threading.TIMEOUT_MAX:  # a deadline too far to wait for (tests) needs no watchdog
            watchdog = threading.Timer(wait, os._exit, args=(3,))
            watchdog.daemon = True
            watchdog.start()

    def selected(self, name: str) -> bool:
        """Whether --phases asks for the measurement phase `name`."""
        return not self.only or any(fnmatch.fnmatch(name, p) for p in self.only)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        write_json(self.out_path, self.data)

    def run(self, name: str, fn, *, min_left_s: float = 0.0, into: str | None = None) -> bool:
        """Runs fn() -> dict (stored under data[into or name]) unless less than min_left_s remain. True if it
        ran without error."""
        record = self.data["phases"].setdefault(name, {})
        if min_left_s != -float("inf") and not self.selected(name):
            record.update(status="skipped", reason="not selected (--phases)")
            self.save()
            return False
        if self.left() < min_left_s:
            record.update(status="skipped", reason=f"{self.left():.0f} s left of the time budget, need "
                                                    f"{min_left_s:.0f} s")
            self.save()
            print(f"[{self.prefix}] {name}: skipped ({record['reason']})", flush=True)
            return False
        record.update(status="running", started_left_s=round(self.left(), 1))
        self.save()
        start = time.perf_counter()
        try:
            if name in self.failing:
                raise RuntimeError(f"phase {name} failed on purpose ({FAIL_ENV})")
            while name in self.hanging:
                time.sleep(1)
            result = fn()
            if result is not None:
                self.data[into or name] = result
            record.update(status="ok", seconds=round(time.perf_counter() - start, 2))
            line = json.dumps(_short(result), default=str)
            ok = True
        except Exception as e:  # recorded, and the next phase runs
            record.update(status="error", seconds=round(time.perf_counter() - start, 2),
                          error=f"{type(e).__name__}: {str(e)[:1500]}",
                          traceback=traceback.format_exc()[-3000:])
            line = record["error"][:300]
            ok = False
        self.save()
        print(f"[{self.prefix}] {name}: {record['status']} in {record['seconds']} s "
              f"({self.left():.0f} s left) {line[:400]}", flush=True)
        return ok


def _short(result):
    """The printed line leaves out long token lists."""
    if isinstance(result, dict):
        return {k: _short(v) for k, v in result.items() if k != "tokens"}
    return result


def timed(fn, sync, *, repeats: int, deadline: float, cap_s: float = float("inf"), warmed: bool = False) -> dict:
    """The first call (compilation, warm-up) timed on its own, then up to `repeats` timed calls, fewer when the next
    one would pass the deadline or cap_s (seconds for this measurement); at least one unless the first call
    already passed the deadline. Returns first_s, median_s (of the repeats; the first call's when there were
    none), n, times; and the last call's return value under 'value' (for the caller; popped before storing).
    warmed: fn has been warmed up already, so the first call counts as a repeat too."""
    start = time.perf_counter()
    value = fn()
    sync(value)
    first = time.perf_counter() - start
    times = [first] if warmed else []
    while len(times) < repeats:
        last = times[-1] if times else first
        used = time.perf_counter() - start
        if times and (time.time() + last > deadline or used + last > cap_s):
            break
        if not times and time.time() > deadline:
            break
        t = time.perf_counter()
        value = fn()
        sync(value)
        times.append(time.perf_counter() - t)
    ordered = sorted(times)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (
        (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2 if ordered else first)
    return dict(first_s=round(first, 4), median_s=median, n=len(times), times=[round(t, 4) for t in times],
                value=value)


def decode_rate(new_tokens: int, generate_s: float, ttft_s: float):
    """New tokens per second of the decode loop alone: (generation time - prefill time); None when the difference
    is not positive (timing noise on a tiny model)."""
    loop = generate_s - ttft_s
    return new_tokens / loop if loop > 0 else None

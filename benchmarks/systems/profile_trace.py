"""Reading a jax.profiler trace programmatically (jax.profiler.ProfileData over the .xplane.pb it wrote): the
executed HLO ops with their durations, and the host-side annotations we placed around data loading.

Where ops ran: a GPU's kernels sit on its '/device:...' plane, one line per stream; XLA:CPU runs its thunks on
host threads of the '/host:CPU' plane. When device planes carry ops, host-side copies of the same names (launch
records) are ignored so nothing counts twice. Derived summary lines that some profilers add (XLA Ops, XLA
Modules, Steps) repeat the kernels and are skipped.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import tempfile

import jax

DERIVED_LINES = frozenset({"XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Name Scope",
                           "Framework Ops", "Source code", "Async XLA Ops", "Launch Stats"})


@dataclasses.dataclass(frozen=True)
class OpEvent:
    plane: str
    line: str
    name: str
    hlo_op: str | None
    hlo_module: str | None
    start_ns: float
    duration_ns: float
    program_id: int | None = None  # the compiled module's id (XLA's dump names it module_<id>.<name>...)


def xplane_files(logdir: str) -> list[str]:
    """The .xplane.pb files of the newest profiling run under logdir (one per host)."""
    runs = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")), key=os.path.getmtime)
    if not runs:
        raise FileNotFoundError(f"no profile under {logdir}/plugins/profile")
    files = sorted(glob.glob(os.path.join(runs[-1], "*.xplane.pb")))
    if not files:
        raise FileNotFoundError(f"no .xplane.pb in {runs[-1]}")
    return files


def _events(plane, skip_lines=DERIVED_LINES):
    for line in plane.lines:
        if line.name in skip_lines:
            continue
        for ev in line.events:
            stats = dict(ev.stats)  # (jax's ProfileData warns once about its stats type's __module__)
            yield OpEvent(plane.name, line.name, ev.name, stats.get("hlo_op"), stats.get("hlo_module"),
                          float(ev.start_ns), float(ev.duration_ns), stats.get("program_id"))


def load(logdir: str, annotations=("data_loading",)) -> tuple[list[OpEvent], list[OpEvent], list[str]]:
    """(op events, annotation events, names of the lines the ops came from)."""
    device_ops, host_ops, marks = [], [], []
    for path in xplane_files(logdir):
        data = jax.profiler.ProfileData.from_file(path)
        for plane in data.planes:
            if plane.name.startswith("/device:"):
                device_ops += [e for e in _events(plane) if e.hlo_op is not None or _is_kernel_line(e.line)]
            elif plane.name.startswith("/host:"):
                for e in _events(plane):
                    if e.name in annotations:
                        marks.append(e)
                    elif e.hlo_op is not None:
                        host_ops.append(e)
    with_ops = [e for e in device_ops if e.hlo_op is not None]
    ops = device_ops if with_ops else host_ops
    return ops, marks, sorted({f"{e.plane} / {e.line}" for e in ops})


def _is_kernel_line(line_name: str) -> bool:
    """GPU stream lines: kernels there without an HLO op (library calls, e.g. NCCL) still take device time."""
    return line_name.startswith("Stream")


def kernel_key(e: OpEvent) -> str:
    """A kernel's name in a table: its HLO op, or its own name where a command buffer (CUDA graph) replayed it under
    the buffer's op name (for XLA's fusions, the instruction's name with '.' and '-' made '_')."""
    return e.name if not e.hlo_op or e.hlo_op.startswith("command_buffer") else e.hlo_op


def device_ops_of_calls(f, *args, calls: int = 5) -> list[OpEvent]:
    """The device's kernels, in start order, while `calls` back-to-back calls of f(*args) run (after one untraced
    call, which compiles it)."""
    jax.block_until_ready(f(*args))
    logdir = tempfile.mkdtemp(prefix="profile_trace_")
    try:
        with jax.profiler.trace(logdir):
            out = None
            for _ in range(calls):
                out = f(*args)
            jax.block_until_ready(out)
        ops = [e for e in load(logdir)[0] if e.plane.startswith("/device")]
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    return sorted(ops, key=lambda e: e.start_ns)

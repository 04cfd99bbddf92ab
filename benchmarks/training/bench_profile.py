"""Kernel profile of one benchmark variant: two calls under jax.profiler, kernels grouped by class, by phase
(forward / backward / other, from the JAX op_name in the HLO metadata), by op, and by the model source line that
emitted them (the innermost zaya_jax / pallas_kernels frame of the HLO stack, systems/hlo_frames). XLA runs the step
as CUDA command buffers, so per-op attribution may only see command_buffer_N (XLA_FLAGS=
--xla_gpu_enable_command_buffer= turns them off): by_class_ms and top_kernels_ms still hold."""

from __future__ import annotations

import glob
import json
import os

import jax

from benchmarks.systems import hlo_frames
from benchmarks.training.bench_programs import variant_batch


def profile(runner, name: str, workdir: str) -> dict | None:
    """Trace two calls of a compiled variant; returns the breakdown (or None when the variant did not compile)."""
    item = runner.items.get(name)
    if item is None or runner.compiled(name, 0) is None:
        return None
    v, c = item["variant"], item["compiled"]
    if v.kind == "opt":
        raise ValueError(f"profile: variant {name} is an optimizer-only program; profile a step variant")
    batch = variant_batch(item["cfg"], v, seed=2)
    logdir = os.path.join(workdir, f"trace_{name}")
    state = runner.ensure_state(v.state_key)
    reps = 2
    if v.kind in ("step", "accum"):
        runner.states.pop(v.state_key)
        state, _ = c(state, batch)
        jax.block_until_ready(state)
        with jax.profiler.trace(logdir):
            for _ in range(reps):
                state, _ = c(state, batch)
            jax.block_until_ready(state)
        runner.states[v.state_key] = state
    else:
        jax.block_until_ready(c(state, batch))
        with jax.profiler.trace(logdir):
            for _ in range(reps):
                out = c(state, batch)
            jax.block_until_ready(out)
    files = glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb")
    if not files:
        return None
    text = c.as_text()
    return breakdown(jax.profiler.ProfileData.from_file(files[0]), hlo_op_names(text), reps,
                     gpu=jax.devices()[0].platform == "gpu", forward_only=v.kind == "fwd",
                     sources=hlo_sources(text), instructions=hlo_instructions(text))


def hlo_sources(hlo_text: str) -> dict:
    """HLO instruction name -> 'file:line function < caller file:line' of the two innermost project frames that
    emitted it (the caller tells apart the uses of shared helpers)."""
    out = {}
    for name, instr in hlo_frames.parse(hlo_text).instructions.items():
        frames = [f for f in instr.frames if "zaya_jax/" in f.file or "pallas_kernels/" in f.file][:2]
        if frames:
            short = [f"{f.file[f.file.rfind('zaya_jax/' if 'zaya_jax/' in f.file else 'pallas_kernels/'):]}:{f.line}"
                     for f in frames]
            out[name] = f"{short[0]} {frames[0].function}" + (f" < {short[1]}" if len(short) > 1 else "")
    return out


def hlo_instructions(hlo_text: str, width: int = 240) -> dict:
    """HLO instruction name -> its text up to the metadata (result shape, opcode, operands, custom-call target),
    cut to `width` characters: what a kernel computed, next to its time in `top_instructions_ms`."""
    return {name: line.split(", metadata=")[0][:width] for name, line in _instruction_lines(hlo_text)}


def _instruction_lines(hlo_text: str):
    """(instruction name, its line without a ROOT prefix) for every instruction of the HLO text."""
    for line in hlo_text.splitlines():
        line = line.strip().removeprefix("ROOT ")
        if line.startswith("%") and "=" in line:
            yield line[1:line.index("=")].strip(), line


def breakdown(pd, op_names: dict, reps: int, gpu: bool, forward_only: bool, sources: dict | None = None,
              instructions: dict | None = None) -> dict:
    by_class, by_name, by_op, by_phase, by_source, by_instr = {}, {}, {}, {}, {}, {}
    sources, instructions = sources or {}, instructions or {}
    total = 0.0
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU" if gpu else "/host:CPU"):
            continue
        for line in plane.lines:
            if gpu and "Stream" not in line.name:
                continue
            for ev in line.events:
                d = ev.duration_ns / reps / 1e6  # ms per call
                total += d
                hlo = str(dict(ev.stats).get("hlo_op", ""))
                op = op_names.get(hlo, "")
                phase = ("backward" if "transpose(" in op else "forward" if "jvp(" in op or forward_only
                         else "other (optimizer, balancing, copies)")
                for table, key in ((by_class, kernel_class(ev.name)), (by_name, ev.name), (by_phase, phase),
                                   (by_op, f"{phase[:3]} {op_key(op) or hlo or ev.name[:60]}"),
                                   (by_source, f"{phase[:3]} {sources.get(hlo, '(no project frame)')}"),
                                   (by_instr, instructions.get(hlo, hlo or ev.name[:60]))):
                    table[key] = table.get(key, 0) + d
    return {"kernel_ms_per_step": total, "by_phase_ms": dict(_top(by_phase, 10)),
            "by_class_ms": dict(_top(by_class, 20)), "top_ops_ms": _top(by_op, 60), "top_kernels_ms": _top(by_name, 40),
            "top_sources_ms": _top(by_source, 60), "top_instructions_ms": _top(by_instr, 200, 240),
            **({"busiest_stream": stream_gaps(pd, reps)} if gpu else {})}


def _top(dct: dict, n: int, width: int = 200) -> list:
    return [[k[:width], round(t, 3)] for k, t in sorted(dct.items(), key=lambda kv: -kv[1])[:n]]


def stream_gaps(pd, reps: int) -> dict:
    """Where the GPU waits: on the stream with the most kernel time, its span, busy and idle time per call, and the
    idle time before each kernel (by class and by name). Two programs with the same kernel time can differ here, e.g.
    by launches that do not keep ahead of the GPU."""
    best = None
    for plane in pd.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "Stream" in line.name:
                    evs = sorted(((e.start_ns, e.end_ns, e.name) for e in line.events))
                    busy = sum(end - start for start, end, _ in evs)
                    if evs and (best is None or busy > best[0]):
                        best = (busy, evs)
    if best is None:
        return {}
    busy, evs = best
    idle_class, idle_name, reach = {}, {}, evs[0][1]
    for start, end, name in evs[1:]:
        gap = max(0, start - reach) / reps / 1e6
        if gap:
            idle_class[kernel_class(name)] = idle_class.get(kernel_class(name), 0) + gap
            idle_name[name] = idle_name.get(name, 0) + gap
        reach = max(reach, end)
    span = (reach - evs[0][0]) / reps / 1e6
    return {"span_ms_per_call": span, "busy_ms_per_call": busy / reps / 1e6, "idle_ms_per_call": sum(idle_class.values()),
            "kernels_per_call": len(evs) / reps, "idle_before_class_ms": dict(_top(idle_class, 20)),
            "idle_before_kernel_ms": _top(idle_name, 30)}


def summary_line(name: str, prof: dict) -> str:
    return (f"profile {name}: {prof['kernel_ms_per_step']:.1f} ms of kernels per call; by phase "
            + json.dumps(prof["by_phase_ms"]) + "; by class " + json.dumps(dict(list(prof["by_class_ms"].items())[:8]))
            + (f"; busiest stream idle {prof['busiest_stream']['idle_ms_per_call']:.1f} ms per call"
               if prof.get("busiest_stream") else ""))


def hlo_op_names(hlo_text: str) -> dict:
    """HLO instruction name -> the JAX op_name in its metadata (e.g. 'jit(train_step)/transpose(jvp(...))/dot')."""
    out = {}
    for name, line in _instruction_lines(hlo_text):
        i = line.find('op_name="')
        if i >= 0:
            out[name] = line[i + 9:line.find('"', i + 9)]
    return out


def op_key(op_name: str) -> str:
    """A readable key for an op_name: drop the jit( ) wrapper and jvp/transpose wrappers, keep the path."""
    if not op_name:
        return ""
    parts = op_name.split("/")[1:] or [op_name]
    clean = []
    for p in parts:
        while p.startswith(("jvp(", "transpose(", "checkpoint(", "remat(")) and p.endswith(")"):
            p = p[p.index("(") + 1:-1]
        clean.append(p)
    return "/".join(clean)[-160:]


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("cudnn", "fmha", "flash", "sdpa", "attention")):
        return "attention"
    if "ragged" in n or "grouped" in n:
        return "grouped_gemm"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "dot")):
        return "gemm"
    if "triton" in n or "pallas" in n or "rms" in n:
        return "triton/pallas"
    if any(s in n for s in ("memcpy", "memset", "copy")):
        return "copy/memset"
    if any(s in n for s in ("sort", "scatter", "gather", "argsort", "cub")):
        return "sort/gather/scatter"
    if "reduce" in n:
        return "reduction"
    if "fusion" in n or "loop" in n or "transpose" in n or "convert" in n:
        return "elementwise fusion"
    return "other"

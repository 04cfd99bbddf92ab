"""Reading a compiled HLO module's text: every instruction's opcode, op_name and the Python call stack that
produced it (the module's FileNames / FunctionNames / FileLocations / StackFrames tables, which jax fills from
the tracing-time traceback). The stack is what lets a profiled kernel be attributed to the model code that
emitted it, through helpers like a shared Linear and through jvp/transpose, without names in the model.
"""

from __future__ import annotations

import dataclasses
import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-_]*)\(([^)]*)\)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_MODULE = re.compile(r"^HloModule\s+([^\s,]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# Inside a fusion without metadata of its own, the op that best says what the fusion is for.
_TELLING_OPCODES = ("dot", "convolution", "custom-call", "ragged-dot", "reduce", "scatter", "gather")
_FIELDS = re.compile(r"(\w+)=(\d+)")


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    op_name: str
    frames: tuple[Frame, ...]  # innermost call first
    calls: str | None = None  # the computation a fusion / call runs
    operands: tuple[str, ...] = ()


@dataclasses.dataclass
class HloIndex:
    module: str
    instructions: dict[str, Instruction]

    def get(self, name: str) -> Instruction | None:
        return self.instructions.get(name)


def _table(lines: list[str], title: str) -> dict[int, str]:
    """Rows 'ID rest' under a bare title line, up to the next blank or non-row line."""
    try:
        start = lines.index(title) + 1
    except ValueError:
        return {}
    rows = {}
    for line in lines[start:]:
        head, _, rest = line.partition(" ")
        if not head.isdigit():
            break
        rows[int(head)] = rest
    return rows


def _stack_frames(lines: list[str]) -> tuple[dict[int, Frame], dict[int, tuple[int, int]]]:
    files = {k: v.strip('"') for k, v in _table(lines, "FileNames").items()}
    functions = {k: v.strip('"') for k, v in _table(lines, "FunctionNames").items()}
    locations = {}
    for k, v in _table(lines, "FileLocations").items():
        f = dict(_FIELDS.findall(v))
        locations[k] = Frame(files.get(int(f["file_name_id"]), "?"), functions.get(int(f["function_name_id"]), "?"),
                             int(f.get("line", 0)))
    frames = {}
    for k, v in _table(lines, "StackFrames").items():
        f = dict(_FIELDS.findall(v))
        frames[k] = (int(f["file_location_id"]), int(f["parent_frame_id"]))
    return locations, frames


def _chain(frame_id: int, locations, frames) -> tuple[Frame, ...]:
    # The printed parent_frame_id is one more than the parent's printed id (0 -> no parent); pinned by
    # tests/test_systems_breakdown.py against a real compile.
    out, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        location, parent = frames[frame_id]
        if location in locations:
            out.append(locations[location])
        frame_id = parent - 1
    return tuple(out)


def parse(text: str) -> HloIndex:
    lines = text.splitlines()
    module = next((m.group(1) for m in map(_MODULE.match, lines[:5]) if m), "?")
    locations, frames = _stack_frames(lines)
    chains: dict[int, tuple[Frame, ...]] = {}
    instructions: dict[str, Instruction] = {}
    bodies: dict[str, list[str]] = {}  # computation -> its instruction names, in order
    current = None
    for line in lines:
        header = _COMPUTATION.match(line)
        if header:
            current = bodies.setdefault(header.group(1), [])
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, opcode, args = m.groups()
        op_name = _OP_NAME.search(line)
        fid = _FRAME_ID.search(line)
        frames_of = ()
        if fid:
            i = int(fid.group(1))
            if i not in chains:
                chains[i] = _chain(i, locations, frames)
            frames_of = chains[i]
        calls = _CALLS.search(line)
        instructions[name] = Instruction(name, opcode, op_name.group(1) if op_name else "", frames_of,
                                         calls.group(1) if calls else None, tuple(_OPERAND.findall(args)))
        if current is not None:
            current.append(name)
    for name, instr in list(instructions.items()):
        if not instr.frames and instr.calls:
            inner = _telling(instr.calls, bodies, instructions, depth=0)
            if inner is not None:
                instructions[name] = dataclasses.replace(instr, op_name=inner.op_name, frames=inner.frames)
    for name, instr in list(instructions.items()):
        if not instr.frames and instr.opcode not in _NO_BORROW:
            source = _from_operands(instr, instructions)
            if source is not None:
                instructions[name] = dataclasses.replace(instr, op_name=source.op_name, frames=source.frames)
    return HloIndex(module, instructions)


# Ops that only move data between program parts: borrowing a producer's stack would misattribute them.
_NO_BORROW = frozenset({"parameter", "tuple", "get-tuple-element", "constant", "while", "conditional", "call"})


def _from_operands(instr: Instruction, instructions, depth: int = 3) -> Instruction | None:
    """Some compiler passes rebuild an op without its metadata (XLA:CPU re-emits bf16 dots in fp32, for one);
    such an op belongs with the nearest producer that kept a stack (breadth first, a few levels up)."""
    frontier = list(instr.operands)
    for _ in range(depth):
        nxt = []
        for name in frontier:
            op = instructions.get(name)
            if op is None:
                continue
            if op.frames:
                return op
            nxt += op.operands
        frontier = nxt
    return None


def _telling(computation: str, bodies, instructions, depth: int) -> Instruction | None:
    """The instruction of a called computation whose stack stands for the whole: its first matmul-like op with a
    stack, else its last op with one (the root comes last), looking through nested fusions."""
    members = [instructions[n] for n in bodies.get(computation, ()) if n in instructions]
    with_frames = [i for i in members if i.frames]
    for i in with_frames:
        if i.opcode in _TELLING_OPCODES:
            return i
    if with_frames:
        return with_frames[-1]
    if depth < 4:
        for i in members:
            if i.calls:
                found = _telling(i.calls, bodies, instructions, depth + 1)
                if found is not None:
                    return found
    return None

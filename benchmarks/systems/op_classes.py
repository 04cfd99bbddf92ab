"""Which part of a training step an HLO instruction belongs to, from its opcode and the Python call stack that
emitted it (hlo_frames). Rules are checked in order and the first that matches any frame of the stack wins, so
an ordering expresses ownership: the router's own RMSNorm is router time, CCA's QK-norm is attention time, and
a Linear in model/base.py belongs to whichever module called it."""

from __future__ import annotations

import dataclasses

from benchmarks.systems.hlo_frames import Instruction

CATEGORIES = ("attention", "experts", "router", "norms", "embed_head_loss", "optimizer", "communication",
              "data_loading", "other")

COLLECTIVE_OPCODES = frozenset({
    "all-reduce", "all-reduce-start", "all-reduce-done", "all-gather", "all-gather-start", "all-gather-done",
    "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute", "collective-permute-start",
    "collective-permute-done", "collective-broadcast", "send", "send-done", "recv", "recv-done"})
# Control flow whose profiled time contains its body's kernels (counting both would count twice).
CONTAINER_OPCODES = frozenset({"while", "conditional", "call"})
COLLECTIVE_KERNEL_HINTS = ("nccl", "rccl", "allreduce", "all_reduce", "allgather", "reducescatter", "alltoall")


@dataclasses.dataclass(frozen=True)
class Rule:
    category: str
    file_suffix: str  # matched against the end of the frame's file path ('/'-separated)
    function: str | None = None  # exact function qualname, or any
    innermost_only: bool = False


RULES = (
    Rule("optimizer", "zaya_jax/optim/muon.py"),
    Rule("optimizer", "zaya_jax/optim/optimizer.py"),
    Rule("optimizer", "zaya_jax/ops/newton_schulz.py"),
    Rule("optimizer", "pallas_kernels/symmetric_matmul.py"),
    Rule("router", "zaya_jax/optim/balancing.py"),  # the bias controller runs once per step on the router's counts
    Rule("optimizer", "/optax/", None),  # any optax module (matched as a path fragment, see _matches)
    Rule("experts", "zaya_jax/model/experts.py"),
    Rule("router", "zaya_jax/model/router.py"),
    Rule("router", "zaya_jax/model/layer.py", "MoE.__call__"),  # expert counts / one-hot around the router
    Rule("attention", "zaya_jax/model/cca.py"),
    Rule("attention", "zaya_jax/ops/attention.py"),
    Rule("attention", "pallas_kernels/cca_attention.py"),
    Rule("norms", "zaya_jax/ops/rmsnorm.py"),
    Rule("norms", "pallas_kernels/rmsnorm.py"),
    Rule("embed_head_loss", "zaya_jax/model/loss.py"),
    Rule("embed_head_loss", "zaya_jax/model/zaya.py", "ZayaForCausalLM.logits"),
    Rule("embed_head_loss", "zaya_jax/model/zaya.py", "ZayaForCausalLM.head_weight"),
    Rule("embed_head_loss", "zaya_jax/model/zaya.py", "ZayaModel.__call__", innermost_only=True),
    Rule("embed_head_loss", "zaya_jax/train/step.py", "make_loss_fn.<locals>.loss_fn", innermost_only=True),
)


def _matches(rule: Rule, frame) -> bool:
    path = frame.file.replace("\\", "/")
    where = rule.file_suffix in path if rule.file_suffix.startswith("/") else path.endswith(rule.file_suffix)
    return where and (rule.function is None or frame.function == rule.function)


def classify(instr: Instruction | None, event_name: str = "", rules=RULES) -> str:
    """Category of one profiled op: its HLO instruction if known, else what its kernel name suggests."""
    if instr is None:
        lowered = event_name.lower()
        return "communication" if any(h in lowered for h in COLLECTIVE_KERNEL_HINTS) else "other"
    if instr.opcode in COLLECTIVE_OPCODES:
        return "communication"
    for rule in rules:
        frames = instr.frames[:1] if rule.innermost_only else instr.frames
        if any(_matches(rule, f) for f in frames):
            return rule.category
    return "other"


def is_container(instr: Instruction | None) -> bool:
    return instr is not None and instr.opcode in CONTAINER_OPCODES

"""The iteration-time breakdown: reading HLO stack frames, the category rules, and a real profiled training step
on the CPU (2 data-parallel devices, so gradient all-reduces appear), including the memory model against the
compiled step's allocation."""

import pytest

from benchmarks.systems import breakdown, hlo_frames, op_classes
from benchmarks.systems.hlo_frames import Frame, Instruction

HLO = """HloModule jit_step, is_scheduled=true

FileNames
1 "/src/zaya_jax/train/step.py"
2 "/src/zaya_jax/model/experts.py"
3 "/src/zaya_jax/model/base.py"
4 "/src/zaya_jax/model/router.py"

FunctionNames
1 "train_step"
2 "_ragged"
3 "Linear.__call__"
4 "Router.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=52 end_line=52 column=1 end_column=2}
3 {file_name_id=3 function_name_id=3 line=35 end_line=35 column=1 end_column=2}
4 {file_name_id=4 function_name_id=4 line=40 end_line=40 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=4 parent_frame_id=2}
4 {file_location_id=3 parent_frame_id=4}

ENTRY %main (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %dot.1 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/dot_general" stack_frame_id=2}
  %fusion.7 = f32[4,4]{1,0} fusion(%dot.1), kind=kLoop, calls=%fc, metadata={op_name="jit(step)/dot_general" stack_frame_id=4}
  %all-reduce.3 = f32[4,4]{1,0} all-reduce(%fusion.7), replica_groups={}, to_apply=%add
  ROOT %t = (f32[4,4]{1,0}, s32[]) tuple(%all-reduce.3, %p)
}
"""


def test_hlo_text_gives_opcodes_and_call_stacks():
    index = hlo_frames.parse(HLO)
    assert index.module == "jit_step"
    dot = index.get("dot.1")
    assert dot.opcode == "dot" and dot.op_name == "jit(step)/dot_general"
    # frame 2 (experts.py) printed with parent 2 = frame 1 (step.py): innermost first
    assert [(f.file.split("/")[-1], f.function) for f in dot.frames] == [("experts.py", "_ragged"),
                                                                         ("step.py", "train_step")]
    fusion = index.get("fusion.7")
    assert [f.function for f in fusion.frames] == ["Linear.__call__", "Router.__call__", "train_step"]
    # an op a compiler pass left without metadata takes its producer's stack; pure plumbing never does
    assert index.get("all-reduce.3").frames == fusion.frames
    assert index.get("t").opcode == "tuple" and index.get("t").frames == ()


def _instr(opcode, *frames):
    return Instruction("x", opcode, "", tuple(Frame(f, fn, 1) for f, fn in frames))


@pytest.mark.parametrize("frames, opcode, want", [
    ([("/r/zaya_jax/model/base.py", "Linear.__call__"), ("/r/zaya_jax/model/cca.py", "CCAttention.__call__")],
     "fusion", "attention"),  # a shared Linear belongs to its caller
    ([("/r/zaya_jax/ops/rmsnorm.py", "rms_norm_reference"), ("/r/zaya_jax/model/router.py", "Router.__call__")],
     "fusion", "router"),  # the router's own norm is router time
    ([("/r/zaya_jax/ops/rmsnorm.py", "merge_rms_norm"), ("/r/zaya_jax/model/layer.py", "DecoderLayer.__call__")],
     "fusion", "norms"),
    ([("/r/zaya_jax/model/experts.py", "_ragged"), ("/r/zaya_jax/model/layer.py", "MoE.__call__")],
     "custom-call", "experts"),
    ([("/v/site-packages/optax/_src/transform.py", "update_fn"), ("/r/zaya_jax/train/step.py", "train_step")],
     "fusion", "optimizer"),
    ([("/r/zaya_jax/ops/newton_schulz.py", "newton_schulz"), ("/r/zaya_jax/optim/muon.py", "direction")],
     "dot", "optimizer"),
    ([("/r/zaya_jax/model/zaya.py", "ZayaForCausalLM.logits")], "dot", "embed_head_loss"),
    ([("/r/zaya_jax/model/zaya.py", "ZayaModel.__call__")], "gather", "embed_head_loss"),
    ([("/r/zaya_jax/model/layer.py", "DecoderLayer.__call__"), ("/r/zaya_jax/model/zaya.py", "ZayaModel.__call__")],
     "copy", "other"),
    ([], "all-reduce-start", "communication"),
])
def test_category_rules(frames, opcode, want):
    assert op_classes.classify(_instr(opcode, *frames)) == want


def test_kernels_without_an_hlo_op_are_classified_by_name():
    assert op_classes.classify(None, "ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert op_classes.classify(None, "memset") == "other"
    assert op_classes.is_container(_instr("while")) and not op_classes.is_container(_instr("fusion"))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    # two layers: the trainer refuses one (its router_states_scale [L - 1, ...] would be empty)
    bc = breakdown.BreakdownConfig(preset="tiny", overrides=(("num_hidden_layers", 2),), seq_len=32, rows=4, steps=1,
                                   devices=2, prefetch=0, fast_cpu_compile=True)
    out = tmp_path_factory.mktemp("breakdown")
    return breakdown.run(bc, str(out), log=lambda *_: None), out


@pytest.mark.slow  # a benchmark tool's real run (CI's slow pass); its parsing and rules: the tests above
def test_profiled_cpu_step_is_split_into_categories(profiled):
    result, out = profiled
    t = result["seconds_per_step"]
    for cat in ("attention", "experts", "router", "optimizer", "communication", "data_loading"):
        assert t[cat] > 0, cat
    assert sum(result["share"].values()) == pytest.approx(1.0)
    assert result["unmatched_ops"] == 0 and result["module"].startswith("jit_")
    collectives = ("all-reduce", "reduce-scatter", "all-gather")  # the trainer's ZeRO-1 step uses all three
    assert any(o["category"] == "communication" and any(c in o["op"] for c in collectives) for o in result["top_ops"])
    known = sum(t[c] for c in ("attention", "experts", "router", "norms", "embed_head_loss", "optimizer"))
    assert t["other"] < 0.25 * known  # nearly every op is attributed to a part of the model or optimizer
    assert (out / "breakdown.json").exists() and (out / "breakdown.png").stat().st_size > 1000


@pytest.mark.slow
def test_memory_model_matches_the_compiled_step(profiled):
    """The memory model (recipe zaya_jax: what this trainer keeps) against XLA's own buffer assignment for the very
    step that was profiled."""
    memory = profiled[0]["memory"]
    assert 0.8 < memory["predicted_over_compiled"] < 1.25, memory

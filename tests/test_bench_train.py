"""The training benchmark's modules on the CPU (benchmarks/training/bench*.py): variant selection, the memory searches'
walk, the report's ratios and HF's derived accumulation figure, the HF process driver, a run of the main,
breakdown and accumulation programs end to end, a rejected config override reported per variant, and the train
state rebuilt after a failed call consumed its donated buffers."""

import argparse
import json
import sys
import threading
import time
import types

import jax
import pytest

from benchmarks.training import bench, bench_hf, bench_report
from benchmarks.training.bench_hf_driver import HFProcess
from benchmarks.training.bench_runner import Runner
from benchmarks.training.bench_timing import Clock
from benchmarks.training.bench_variants import (
    Search,
    Variant,
    default_variants,
    extra_variants,
    select,
    with_ce_chunk,
)


def args_for(tmp_path, *extra):
    return bench.parse_args(["--preset", "tiny", "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
                             "--no-hf", "--ce-chunk", "24", "--compile-threads", "2", "--long-seq", "64",
                             "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "report.json"), *extra])


def test_selection_and_validation():
    vs, searches = default_variants(2, 4096, gpu=True, long_seq=32768, ladder=[4, 6, 8], accums=[4, 16])
    names = [v.name for v in vs]
    for want in ("main", "fwd", "fwd_bwd", "opt_zaya", "main_adamw", "opt_adamw", "moe_ragged", "accum4",
                 "accum16", "ctx32k_accum4"):  # 32k with as many tokens per update as accum16
        assert want in names
    assert not any(n.endswith("_once") for n in names)  # the trainer's program IS the summed-once update
    assert {s.name: [c.name for c in s.candidates] for s in searches} == {
        "ctx32k": ["ctx32k", "ctx32k_remat_save_dots", "ctx32k_remat_full"],
        "largest_batch": ["batch4", "batch6", "batch8"]}
    acc = next(v for v in vs if v.name == "accum16")
    assert acc.tokens == 16 * 2 * 4096 and acc.state_key == "zaya"  # the main step's state: no accumulator in it
    chosen, kept = select(vs, searches, extra_variants(2, 4096, True), "main,scan,batch6", "")
    assert [v.name for v in chosen] == ["main", "scan"]
    assert [(s.name, [c.name for c in s.candidates]) for s in kept] == [("largest_batch", ["batch6"])]
    _, kept = select(vs, searches, [], "", "ctx32k")
    assert [s.name for s in kept] == ["largest_batch"]
    with pytest.raises(ValueError, match="unknown variant"):
        select(vs, searches, [], "main,nope", "")
    with pytest.raises(ValueError, match="accum"):
        Variant("x", 2, 32, accum=4)


def test_cudnn_attention_on_nvidia_and_the_pallas_kernel_as_its_ab():
    """On NVIDIA every default variant runs cuDNN's attention (the fastest there); elsewhere the Pallas kernel (GPU)
    or XLA (CPU); the *_pallas_attn extras keep the Pallas side of the A/B."""
    for gpu, cudnn, want in ((True, True, "cudnn"), (True, False, "pallas"), (False, False, "xla")):
        vs, searches = default_variants(2, 4096, gpu=gpu, long_seq=32768, ladder=[4], accums=[16], cudnn=cudnn)
        assert {v.attention_impl for v in vs} | {c.attention_impl for s in searches for c in s.candidates} == {want}
    extras = {v.name: v for v in extra_variants(2, 4096, True, cudnn=True)}
    assert extras["accum16_ce4096"].attention_impl == "cudnn"
    assert extras["accum16_pallas_attn"].attention_impl == extras["fwd_bwd_pallas_attn"].attention_impl == "pallas"


def test_the_ce_chunk_option_leaves_the_other_side_of_an_ab_alone():
    """--ce-chunk sets the head chunk of the variants on the default one; an A/B variant naming its own chunk (or full
    logits) keeps it, else fwd_bwd_ce4096 would time the same program as fwd_bwd."""
    defaults, _ = default_variants(2, 4096, gpu=True, long_seq=32768, ladder=[4], accums=[16])
    by_name = {v.name: v for v in defaults + extra_variants(2, 4096, True)}
    assert with_ce_chunk(by_name["fwd_bwd"], 2048).ce_chunk == 2048
    assert with_ce_chunk(by_name["fwd_bwd_ce4096"], 2048).ce_chunk == 4096
    assert with_ce_chunk(by_name["accum16_ce4096"], 2048).ce_chunk == 4096
    assert with_ce_chunk(by_name["full_ce"], 2048).ce_chunk is None


def test_moe_tiling_variants_replace_real_fields_and_only_while_tracing(monkeypatch):
    """The *_moe_units128 A/B variants name GroupedTiling fields; the override holds inside the context only and
    gives the H200 another tiling than the default."""
    from pallas_kernels import platform
    from pallas_kernels import grouped_matmul as gk
    monkeypatch.setattr(platform, "vendor", lambda: "cuda")
    by_name = {v.name: v for v in extra_variants(2, 4096, True)}
    units128 = dict(by_name["accum16_moe_units128"].moe_tiling)
    assert units128 and dict(by_name["fwd_bwd_moe_units128"].moe_tiling) == units128
    default = gk.default_tiling(jax.numpy.bfloat16)
    with gk.tiling_override(**units128):
        inside = gk.default_tiling(jax.numpy.bfloat16)
    assert inside != default and all(getattr(inside, k) == v for k, v in units128.items())
    assert gk.default_tiling(jax.numpy.bfloat16) == default
    from zaya_jax.ops import grouped_matmul as gmm
    with gk.tiling_override(**units128):
        assert gmm.block_rows(jax.numpy.bfloat16) == 128  # the layout's row unit follows the override too
    assert gmm.block_rows(jax.numpy.bfloat16) == default.block_rows
    with pytest.raises(ValueError, match="not GroupedTiling fields"):
        with gk.tiling_override(fwd_tiles=2):
            pass


class FakeCompiled:
    def __init__(self, gib):
        self.gib = gib

    def memory_analysis(self):
        return types.SimpleNamespace(argument_size_in_bytes=int(self.gib * 2 ** 30), output_size_in_bytes=0,
                                     alias_size_in_bytes=0, temp_size_in_bytes=0)


def fake_search(tmp_path, mode, sizes, gate=None):
    """A search over fake candidates whose compiled programs need `sizes` GiB, against a 30 GiB limit; candidate
    i waits for gate[i] (a threading.Event) before its compile returns, when given."""
    runner = Runner(args_for(tmp_path, "--memory-limit-gib", "30"), {"log": []}, Clock(1e9), lambda m: None)
    cands = [Variant(f"c{i}", 2, 32) for i in range(len(sizes))]
    items = []
    for i, (v, gib) in enumerate(zip(cands, sizes)):
        def compile_(gib=gib, i=i):
            if gate:
                gate[i].wait(30)
            return FakeCompiled(gib)
        items.append({"variant": v, "lowered": types.SimpleNamespace(compile=compile_)})
        runner.items[v.name] = items[-1]
    runner.start_search(Search("s", mode, tuple(cands)), items, deadline=float("inf"))
    return runner


@pytest.mark.parametrize(("mode", "sizes", "chosen", "tried"), [
    ("largest", [10, 20, 40, 50], "c1", 3),  # walks up, stops at the first that does not fit
    ("first", [40, 45, 20, 10], "c2", 3),  # keeps the first that fits
])
def test_memory_search_walk(tmp_path, mode, sizes, chosen, tried):
    runner = fake_search(tmp_path, mode, sizes)
    assert runner.search_choice("s", float("inf")).name == chosen
    rep = runner.report["searches"]["s"]
    assert rep["chosen"] == chosen and len(rep["tried"]) == tried
    assert [t["fits"] for t in rep["tried"]] == [g <= 30 * 0.92 for g in sizes[:tried]]
    assert "compiled" in runner.items[chosen]


def test_memory_search_taken_at_its_deadline(tmp_path):
    gate = [threading.Event() for _ in range(3)]
    gate[0].set()
    runner = fake_search(tmp_path, "largest", [10, 20, 25], gate)
    deadline = time.time() + 30
    while not runner.report["searches"]["s"]["chosen"] and time.time() < deadline:
        time.sleep(0.01)
    assert runner.search_choice("s", time.time() + 0.05).name == "c0"  # c1 still compiling: take c0
    for g in gate:
        g.set()
    runner.searches["s"].result(30)
    rep = runner.report["searches"]["s"]
    assert rep["chosen"] == "c0" and rep["closed_at_deadline"]  # the walk stopped changing its choice


def test_report_ratios_and_derived_hf_accumulation():
    ma = {"peak_estimate_gib": 40.0}
    step = lambda s, **kw: {"kind": "step", "batch": 2, "seq": 4096, "accum": 1, "median_s": s,
                            "tokens_per_s": 8192 / s, "mfu": 0.1 * 0.4 / s, "memory_analysis": ma, "note": "", **kw}
    report = {"batch": 2, "seq": 4096, "flops_per_token": {"4096": 4.3e9}, "variants": {
        "main": step(0.4), "main_adamw": step(0.25),
        "fwd": {**step(0.06), "kind": "fwd"}, "fwd_bwd": {**step(0.2), "kind": "fwd_bwd"},
        "opt_zaya": {**step(0.18), "kind": "opt", "tokens_per_s": None},
        "accum16": step(16 * 0.2 + 0.18, kind="accum", accum=16,
                        tokens_per_s=16 * 8192 / (16 * 0.2 + 0.18)),
        "accum64": step(64 * 0.09, kind="accum", accum=64, tokens_per_s=64 * 8192 / (64 * 0.09)),
        "ctx32k_accum16": step(16 * 0.4, kind="accum", accum=16, batch=1, seq=32768, mfu=0.45,
                               tokens_per_s=16 * 32768 / (16 * 0.4)),
    }, "hf": {"batch": 2, "seq": 4096,
              "eager": {"median_s": 0.3, "tokens_per_s": 8192 / 0.3, "fwd_bwd_s": 0.25, "optimizer_s": 0.05},
              "compiled": {"median_s": 0.128, "tokens_per_s": 8192 / 0.128, "fwd_bwd_s": 0.11,
                           "optimizer_s": 0.018, "accum64": {"k": 64, "median_s": 7.2,
                                                              "tokens_per_s": 64 * 8192 / 7.2}}}}
    lines = bench_report.summarize(report)
    assert report["hf_variant"] == "compiled" and report["ratio_vs_hf"] == pytest.approx(0.128 / 0.4)
    assert report["ratio_vs_hf_same_optimizer"] == pytest.approx(0.128 / 0.25)
    hf16 = 16 * 8192 / (16 * 0.11 + 0.018)
    acc = report["accumulation"]["accum16"]
    assert acc["hf_tokens_per_s_derived"] == pytest.approx(hf16)
    assert report["ratio_vs_hf_accum16"] == pytest.approx(16 * 8192 / (16 * 0.2 + 0.18) / hf16)
    assert acc["optimizer_share"] == pytest.approx(0.18 / (16 * 0.2 + 0.18))
    assert "DERIVED" in report["ratio_labels"]["ratio_vs_hf_accum16"]
    assert report["ratio_vs_hf_bound_update_alone"] == pytest.approx(0.128 / 0.18)  # the update alone vs HF's step
    # accum64: HF's accumulated step measured whole, so the ratio is against that (the derived figure stays listed)
    acc64 = report["accumulation"]["accum64"]
    assert acc64["hf_tokens_per_s_measured"] == pytest.approx(64 * 8192 / 7.2)
    assert acc64["hf_tokens_per_s_derived"] == pytest.approx(64 * 8192 / (64 * 0.11 + 0.018))
    assert report["ratio_vs_hf_accum64"] == pytest.approx(7.2 / (64 * 0.09))
    assert "MEASURED" in report["ratio_labels"]["ratio_vs_hf_accum64"]
    assert set(report["ratio_labels"]) == {"ratio_vs_hf", "ratio_vs_hf_same_optimizer", "ratio_vs_hf_accum16",
                                           "ratio_vs_hf_accum64", "ratio_vs_hf_bound_update_alone"}
    # the long context against the 4k accumulation with as many tokens per update; never against HF's 4k figures
    long = report["long_context_accumulated"]
    assert long["vs"] == "accum64" and long["tokens_per_s_vs_4k"] == pytest.approx(64 * 0.09 / (16 * 0.4))
    assert long["mfu_vs_4k"] == pytest.approx(0.45 / (0.1 * 0.4 / (64 * 0.09)))
    assert "hf_tokens_per_s_derived" not in report["accumulation"]["ctx32k_accum16"]
    bd = report["breakdown"]
    assert bd["optimizer_share"] == pytest.approx(0.18 / 0.4) and bd["backward_ms_derived"] == pytest.approx(140)
    assert report["hf_breakdown"]["optimizer_ms"] == pytest.approx(18)
    assert any(line.startswith("ratio_vs_hf:") for line in lines)


def test_profile_sources_name_the_model_line_that_emitted_each_op():
    import jax.numpy as jnp
    from zaya_jax.ops.rmsnorm import rms_norm_reference
    from benchmarks.training import bench_profile
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    text = jax.jit(lambda x, w: rms_norm_reference(x, w, 1e-6)).lower(x, w).compile().as_text()
    sources = bench_profile.hlo_sources(text)
    assert sources and all(v.startswith("zaya_jax/ops/rmsnorm.py:") for v in sources.values())
    assert any("rms_norm_reference" in v for v in sources.values())


def test_hf_accumulated_step_protocol():
    """HF's measured accumulation: k backward passes of loss / k, then one optimizer step and zero_grad, per step;
    one untimed step, then as many timed ones (2-3) as the deadline leaves room for."""
    calls = []

    class Opt:
        def step(self):
            calls.append("step")

        def zero_grad(self, set_to_none):
            calls.append("zero")

    def timed(fn, reps):
        for _ in range(reps):
            fn()
        return [1.0] * reps

    args = argparse.Namespace(batch=2, seq=8)
    got = bench_hf.time_accumulated(None, lambda m, scale: calls.append(scale), Opt(), 4, timed, lambda: None, args,
                                    fwd_bwd_s=0.01, deadline=time.time() + 60)
    assert calls == ([0.25] * 4 + ["step", "zero"]) * 4  # 1 untimed + 3 timed
    assert got["median_s"] == 1.0 and got["tokens_per_s"] == 4 * 2 * 8
    assert "skipped" in bench_hf.time_accumulated(None, None, None, 4, timed, None, args, fwd_bwd_s=10.0,
                                                  deadline=time.time() + 60)["error"]


def test_hf_driver_command_and_a_failed_process(tmp_path):
    hf = HFProcess(str(tmp_path), log=lambda m: None)
    kw = {"experts": "grouped_mm", "batch": 1, "seq": 8, "steps": 3, "warmup": 1, "ceiling_size": 64,
          "wait_deadline": 5.0, "timing_deadline": 7.0, "compile_model": False}
    hf_args = bench_hf.parse_args(hf.command(sys.executable, **kw)[2:])  # the driver speaks the script's CLI
    assert (hf_args.batch, hf_args.steps, hf_args.timing_deadline, hf_args.no_compile) == (1, 3, 7.0, True)
    assert bench_hf.parse_args(hf.command(sys.executable, **kw, accum=(4, 16))[2:]).accum == "4,16"
    hf.start("false", {"vocab_size": 8}, **kw)  # a process that fails: the run goes on with what it left
    hf.jax_compiled()
    assert hf.wait_exit(60) == "exited 1"
    assert json.loads((tmp_path / "hf_config.json").read_text()) == {"vocab_size": 8}
    assert hf.results() == {"log_tail": ""}


# five compiled variants: slow; test_rejected_override_and_state_rebuilt_after_failure runs the runner's own path
@pytest.mark.slow
def test_run_end_to_end_on_cpu(tmp_path):
    args = args_for(tmp_path, "--variants", "main,opt_zaya,accum2,largest_batch", "--accum", "2",
                    "--batch-ladder", "3")
    rep = bench.run(args)
    assert rep["errors"] == {}
    v = rep["variants"]
    assert v["main"]["loss_finite"] and v["main"]["steps_timed"] == 2
    assert v["accum2"]["tokens_per_call"] == 2 * 2 * 32 and v["accum2"]["loss_finite"]
    assert rep["searches"]["largest_batch"]["chosen"] == "batch3" and v["batch3"]["batch"] == 3
    assert rep["largest_batch"]["batch"] == 3
    assert rep["breakdown"]["optimizer_share"] > 0 and "accum2" in rep["accumulation"]  # CPU timings: noisy
    assert json.loads((tmp_path / "report.json").read_text())["tokens_per_s"] == rep["tokens_per_s"]


@pytest.mark.slow  # a benchmark tool's recovery (CI's slow pass)
def test_rejected_override_and_state_rebuilt_after_failure(tmp_path):
    args = args_for(tmp_path)
    report = {"log": []}
    runner = Runner(args, report, Clock(1e9), lambda m: None)
    main = Variant("main", 2, 32, attention_impl="xla", ce_chunk=24)
    runner.compile_all([Variant("bad_moe", 2, 32, moe_impl="no_such_impl"), main], [], float("inf"))
    assert report["errors"]["bad_moe"].startswith("lower:") and "no_such_impl" in report["errors"]["bad_moe"]
    compiled = runner.compiled("main", float("inf"))
    consumed = []

    def fails_after_donating(state, batch):
        consumed.append(state)
        compiled(state, batch)  # donates the state's buffers, then the "step" fails
        raise RuntimeError("simulated failure after donation")

    runner.items["main"]["compiled"] = fails_after_donating
    assert runner.run_variant(main, float("inf")) is None
    assert "simulated failure" in report["errors"]["main"]
    assert jax.tree.leaves(consumed[0])[0].is_deleted()  # the state really is gone
    assert "zaya" not in runner.states
    runner.items["main"]["compiled"] = compiled
    res = runner.run_variant(main, float("inf"))  # a fresh state is built
    assert res["loss_finite"] and res["tokens_per_s"] > 0


def test_stream_gaps_count_the_idle_time_before_each_kernel():
    """The busiest stream's idle time is attributed to the kernel that ends each wait; overlapping events on the
    stream do not count as idle."""
    from types import SimpleNamespace as NS
    from benchmarks.training import bench_profile
    ev = lambda name, start, end: NS(name=name, start_ns=start * 1_000_000, end_ns=end * 1_000_000)
    stream = NS(name="Stream #1", events=[ev("nvjet_gemm", 0, 10), ev("cca_attention_fwd", 14, 20),
                                          ev("loop_fusion", 18, 22), ev("cca_attention_fwd", 30, 31)])
    quiet = NS(name="Stream #2", events=[ev("memcpy", 0, 1)])
    pd = NS(planes=[NS(name="/device:GPU:0", lines=[quiet, stream])])
    got = bench_profile.stream_gaps(pd, reps=2)  # per call: half of each total
    assert got["span_ms_per_call"] == 15.5 and got["busy_ms_per_call"] == 10.5
    assert got["idle_ms_per_call"] == 6.0 and got["kernels_per_call"] == 2
    assert got["idle_before_kernel_ms"] == [["cca_attention_fwd", 6.0]]
    assert got["idle_before_class_ms"] == {"attention": 6.0}

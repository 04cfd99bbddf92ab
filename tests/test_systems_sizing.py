"""The sizing advisor against hand-computed cases (ZAYA1 on MI300X: DP + ZeRO-1, no TP/EP, microbatch 5 fits at
4k, CP 2 with microbatch 1 at 32k), the memory model's parts, hardware files, and the memory model against the
residuals jax actually saves for this code base."""

import dataclasses
import json

import pytest
from flax import nnx

from benchmarks import size_model
from zaya_jax.config import preset
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.optim import partition
from benchmarks.systems import advisor, hardware, memory_check, memory_model as mm

ZAYA1 = preset("zaya1_base")


def test_vocabulary_padding():
    assert advisor.padded_vocab(262272) == 262272  # the paper's 64 x 4098
    assert advisor.padded_vocab(262145) == 262208
    assert advisor.padded_vocab(1) == 64


def test_muon_and_adamw_split_matches_the_optimizer_partition():
    cfg = preset("tiny")
    model = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    labels = partition.label_params(params)
    import math
    import jax
    muon = sum(math.prod(p.shape) for p, lab in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
               if lab == partition.MUON)
    assert mm.muon_params(cfg) == muon
    assert sum(mm.param_groups(cfg).values()) == cfg.param_counts()["total"]


def test_zaya1_layer_activations_by_hand():
    """Fused-kernel inventory at ZAYA1 widths (D 2048, q 1024, kv 256, conv 1280, I 2048, R 256, E 16), bf16."""
    items = mm.layer_activation_items(ZAYA1, mm.PAPER, 4096)
    by_hand = (4 * 2048 + 2 * 2048 + 2 * 1280 + 2 * 2 * 1280 + 2 * 1280 + 2 * 1.5 * 256 + 2 * 2 * 1280
               + (2 * 1024 + 4 * 8) + 2 * 2048 + (4 * 2048 + 2 * 2048) + 4 * (7 * 256 + 2 * 17)
               + 2 * (3 * 2048 + 3 * 2048) + 4 * 2048)
    assert sum(items.values()) == pytest.approx(by_hand) == pytest.approx(86_952)


def test_zaya1_on_mi300x_at_4k_fits_microbatch_5():
    par = mm.Parallel(dp=1024)
    # static: bf16 weights + fp32 gradients (6 B/param) + fp32 master and states over 1024 ranks
    static = mm.static_bytes(ZAYA1, mm.PAPER, par)
    assert static["weights"] + static["grads"] == pytest.approx(6 * 8_840_488_784)
    assert static["optimizer"] < 0.2e9
    assert mm.largest_microbatch(ZAYA1, mm.PAPER, par, 4096, 192e9, 0.08) == 5
    five = mm.step_memory(ZAYA1, mm.PAPER, par, 4096, 5, 192e9, 0.08)["total"]
    six = mm.step_memory(ZAYA1, mm.PAPER, par, 4096, 6, 192e9, 0.08)["total"]
    assert five <= 192e9 < six


def test_advisor_reproduces_the_papers_choices():
    at4k = advisor.recommend(ZAYA1, hardware.MI300X, advisor.Target(4096, 1024, 2 ** 24))
    assert at4k["parallel"] == dict(dp=1024, tp=1, ep=1, cp=1, zero1=True)
    # 5 fits; the 16M-token batch gives each rank 4 sequences, so 4 is the microbatch (spec section 14)
    assert at4k["microbatch"]["largest_that_fits"] == 5
    assert (at4k["microbatch"]["chosen"], at4k["microbatch"]["accumulation_steps"]) == (4, 1)
    assert at4k["estimates"]["expert_gemm_saturated"]  # 275 GFLOP grouped expert GEMM > ~200 GFLOP
    at32k = advisor.recommend(ZAYA1, hardware.MI300X, advisor.Target(32768, 1024))
    assert at32k["parallel"] == dict(dp=512, tp=1, ep=1, cp=2, zero1=True)
    assert at32k["microbatch"]["chosen"] == 1


def test_advisor_adds_node_wide_expert_parallelism_only_when_memory_forces_it():
    small = dataclasses.replace(hardware.MI300X, hbm_bytes=24e9)
    rec = advisor.recommend(ZAYA1, small, advisor.Target(4096, 1024))
    assert rec["parallel"]["ep"] == 8 and rec["parallel"]["tp"] == 1  # EP spans the node, TP still absent
    tiny_gpu = dataclasses.replace(hardware.MI300X, hbm_bytes=1e9)
    assert advisor.recommend(ZAYA1, tiny_gpu, advisor.Target(4096, 1024))["fits"] is False


def test_h200_fits_less():
    rec = advisor.recommend(ZAYA1, hardware.H200, advisor.Target(4096, 1024, 2 ** 24))
    assert rec["microbatch"]["largest_that_fits"] == 3 and rec["microbatch"]["chosen"] == 2


def test_bucket_estimate_and_hardware_from_sweeps(tmp_path):
    size, source = hardware.MI300X.bucket_bytes()
    assert size == pytest.approx(19 * 30e-6 * 50e9) and "estimated" in source
    device = {"device_kind": "NVIDIA H200", "memory_bytes": 1}
    (tmp_path / "hbm.json").write_text(json.dumps({"device": device, "copy_bandwidth": {"xla": 4.0e12}}))
    (tmp_path / "gemm.json").write_text(json.dumps({"device": device, "best_tflops": 780.0,
                                                    "saturation_flops": 1.5e11}))
    summary = [dict(scope="node", n=8, collective="all_reduce", plateau_busbw=470e9, fit_latency_s=20e-6)]
    (tmp_path / "collectives.json").write_text(json.dumps({"device": device, "summary": summary,
                                                           "bucket": {"bytes": 64 * 2 ** 20}}))
    hw = hardware.load(str(tmp_path))
    assert hw.hbm_bytes == hardware.H200.hbm_bytes  # laid over the preset the device kind names
    assert (hw.hbm_bandwidth, hw.gemm_flops, hw.gemm_saturation_flops) == (4.0e12, 780e12, 1.5e11)
    assert (hw.intra_node_busbw, hw.bucket_bytes()[0]) == (470e9, 64 * 2 ** 20)
    saved = tmp_path / "hardware.json"
    saved.write_text(json.dumps(hw.as_dict()))
    assert hardware.load(str(saved)) == hw


def test_memory_model_matches_the_residuals_jax_saves():
    """Recipe zaya_jax's per-token inventory against print_saved_residuals of the real forward + loss (no remat,
    XLA attention: the T^2 probabilities count), fp32 and bf16."""
    for dtype in ("float32", "bfloat16"):
        cfg = preset("tiny", num_hidden_layers=2, remat="none", vocab_size=512, dtype=dtype)
        check = memory_check.validate(cfg, batch=4, seq_len=128, compile_step=False)
        assert 0.9 < check["saved_ratio"] < 1.15, (dtype, check)


def test_size_model_cli(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert size_model.main(["--seq-len", "32768", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CP 2" in printed and "TP 1, EP 1" in printed
    assert json.loads(out.read_text())["parallel"]["cp"] == 2

"""HBM, GEMM and attention sweeps at tiny sizes: the Pallas streaming kernels' values (interpret mode) and their
Triton lowering for CUDA and ROCm, the byte and FLOP bookkeeping, and the model's GEMM shapes."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import preset
from benchmarks.systems import attention_sweep, gemm, hbm, hbm_pallas
from benchmarks.systems.saturation import saturation_point


def test_pallas_kernels_compute_what_they_claim():
    rows = 2 * hbm_pallas.BLOCK_ROWS
    x = jax.random.normal(jax.random.key(0), (rows, hbm_pallas.COLS), jnp.float32)
    np.testing.assert_array_equal(hbm_pallas.copy(x), x)
    partial = hbm_pallas.read(x)
    assert partial.shape == (2, hbm_pallas.COLS)
    np.testing.assert_allclose(partial.sum(), x.sum(), rtol=1e-5)
    np.testing.assert_allclose(partial[1], x[hbm_pallas.BLOCK_ROWS:].sum(0), rtol=1e-5)
    value = jnp.arange(hbm_pallas.COLS, dtype=jnp.float32)[None]
    np.testing.assert_array_equal(hbm_pallas.write(value, 8), jnp.broadcast_to(value, (8, hbm_pallas.COLS)))
    with pytest.raises(ValueError):
        hbm_pallas.copy(jnp.zeros((96, hbm_pallas.COLS)))  # neither a power of two nor whole blocks


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_pallas_kernels_lower_to_triton(platform, monkeypatch):
    """Lowers each kernel for a GPU without one: Pallas asks the runtime for the compute capability only to pick
    Triton options, so a stand-in answer lets the Triton lowering itself run (and fail here, not on the GPU)."""
    reg = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    if not hasattr(reg, "gpu_info_lib"):
        pytest.skip("this jax looks up the GPU differently")
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))
    x = jax.ShapeDtypeStruct((256, hbm_pallas.COLS), jnp.float32)
    v = jax.ShapeDtypeStruct((1, hbm_pallas.COLS), jnp.float32)
    compiled = dict(interpreted=False)
    for fn, arg in ((lambda x: hbm_pallas.copy(x, **compiled), x), (lambda x: hbm_pallas.read(x, **compiled), x),
                    (lambda v: hbm_pallas.write(v, 256, **compiled), v)):
        text = jax.jit(fn).trace(arg).lower(lowering_platforms=(platform,)).as_text()
        assert "__gpu$xla.gpu.triton" in text  # the Triton custom call, not the interpreter


def test_hbm_sweep_counts_bytes(tmp_path):
    result = hbm.run(str(tmp_path), min_bytes=256 * 1024, max_bytes=256 * 1024, target_s=0.001,
                     log=lambda *_: None)
    by = {(r["impl"], r["op"]): r for r in result["records"]}
    size = 256 * 1024
    assert by["xla", "copy"]["bytes_moved"] == 2 * size and by["pallas", "copy"]["bytes_moved"] == 2 * size
    assert by["xla", "write"]["bytes_moved"] == size
    assert by["pallas", "read"]["bytes_moved"] == size + size // hbm_pallas.BLOCK_ROWS  # plus the partial sums
    for r in result["records"]:
        assert r["bandwidth"] == pytest.approx(r["bytes_moved"] / r["seconds"])
    assert set(result["copy_bandwidth"]) == {"xla", "pallas"}
    assert (tmp_path / "hbm.png").stat().st_size > 1000


def test_model_gemm_shapes_of_zaya1():
    shapes = {s.name: s for s in gemm.model_shapes(preset("zaya1_8b"))}
    assert (shapes["attn_q"].k, shapes["attn_q"].n) == (2048, 1024)
    assert (shapes["attn_k"].k, shapes["attn_k"].n) == (2048, 256)
    assert (shapes["expert_gate_up"].k, shapes["expert_gate_up"].n) == (2048, 4096)
    assert (shapes["expert_down"].k, shapes["expert_down"].n) == (2048, 2048)
    assert shapes["lm_head"].n == 262272 and shapes["experts_gate_up_grouped"].groups == 16
    # an expert up-projection costs 2 x 2048 x 4096 = 16.8 MFLOP per routed token (perf_anchors section 0.1)
    assert shapes["expert_gate_up"].flops(1) == pytest.approx(16.78e6, rel=1e-3)


def test_gemm_sweep_reports_per_shape_and_headline(tmp_path):
    cfg = preset("tiny")
    result = gemm.run(cfg, str(tmp_path), m_min=64, m_max=64, square_min=64, square_max=256, target_s=0.001,
                      log=lambda *_: None)
    names = {r["shape"] for r in result["records"]}
    assert names >= {"attn_q", "expert_gate_up", "experts_gate_up_grouped", "lm_head", "square"}
    for r in result["records"]:
        assert r["tflops"] == pytest.approx(2 * r["m"] * r["k"] * r["n"] / r["seconds"] / 1e12)
    assert result["best_tflops"] == max(r["tflops"] for r in result["records"])
    # the headline is the square curve's saturation point (None where a noisy last point dips below 90%: timings
    # of 1 ms on a loaded CI machine; saturation_point itself is tested on fixed curves)
    square = [r for r in result["records"] if r["shape"] == "square"]
    assert result["saturation_flops"] == saturation_point([r["flops"] for r in square],
                                                          [r["tflops"] for r in square], gemm.SATURATION_FRACTION).x
    assert len(square) == 3
    assert (tmp_path / "gemm.png").stat().st_size > 1000


def test_attention_flops_and_roofline_by_hand(tmp_path):
    cfg = preset("zaya1_8b")
    # causal forward 2 matmuls x 2 x T^2/2 x H x d, times 3.5 for forward + backward
    assert attention_sweep.flops(cfg, 1, 4096) == pytest.approx(3.5 * 2 * 4096 ** 2 * 8 * 128)
    # fused traffic per token: 6 x 1024 + 6 x 256 bf16 values = 15,360 B; intensity = 7168 T / 15360
    assert attention_sweep.fused_bytes(cfg, 1, 1) == 15360
    assert attention_sweep.roofline_crossover(cfg, 708e12, 4.33e12) == pytest.approx(708 / 4.33 * 15360 / 7168)
    result = attention_sweep.run(preset("tiny"), str(tmp_path), tokens=128, min_len=64, max_len=128,
                                 target_s=0.001, log=lambda *_: None)
    assert [(r["length"], r["batch"]) for r in result["records"]] == [(64, 2), (128, 1)]
    assert (tmp_path / "attention.png").stat().st_size > 1000


def test_torch_crosscheck_says_why_it_cannot_run_here():
    from benchmarks.systems import crosscheck
    if jax.default_backend() != "cpu":
        pytest.skip("a GPU may well have torch")
    figures, why = crosscheck.torch_ceilings(timeout_s=120)
    assert figures is None and why  # no GPU on the CPU runner: a reason, never made-up numbers

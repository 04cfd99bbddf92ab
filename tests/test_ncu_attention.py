"""launch/ncu_attention.py's summary of ncu's raw CSV page (a header row, a units row, one row per kernel)."""

import pytest

from launch.ncu_attention import sass_mix, summarize

HEAD = ["ID", "Kernel Name", "gpu__time_duration.sum", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sass__inst_executed_register_spilling", "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]


def test_kernels_with_units_and_stalls_ordered():
    rows = [HEAD, ["", "", "usecond", "%", "inst", "inst", "inst"],
            ["0", "cca_attention_dq", "1,402.5", "62.05", "0", "1.38", "0.97"],
            ["1", "cudnn_bprop", "2,286.2", "64.17", "1,329,284", "0.5", "1.04"]]
    out = summarize(rows)
    assert [e["kernel"] for e in out] == ["cca_attention_dq", "cudnn_bprop"]
    assert out[0]["ms"] == pytest.approx(1.4025) and out[1]["spill_instructions"] == 1329284
    assert out[0]["tensor_active_pct"] == pytest.approx(62.05)
    assert list(out[0]["stalls_per_issue"]) == ["barrier", "wait"]
    assert list(out[1]["stalls_per_issue"]) == ["wait", "barrier"]
    assert "registers_per_thread" not in out[0]  # absent columns are left out, not invented


def test_not_an_ncu_raw_page():
    with pytest.raises(SystemExit, match="Kernel Name"):
        summarize([["a", "b"], ["1", "2"], ["3", "4"]])


SOURCE_HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples", "Instructions Executed"]


def test_sass_mix_counts_executed_opcodes_per_kernel():
    rows = [["Kernel Name", "cca_attention_fwd_bound", ""], SOURCE_HEAD,
            ["0x10", "      FSETP.GEU.AND P0, PT, R4, -126, PT ;", "3", "3", "2,048"],
            ["0x20", "      @!P0 FMUL R4, R4, 0.5 ;", "1", "1", "2,048"],
            ["0x30", "      MUFU.EX2 R5, R4 ;", "7", "7", "2,048"],
            ["0x40", "      @!P0 FMUL R5, R5, R5 ;", "0", "0", "2,048"],
            ["Kernel Name", "cca_attention_dq", ""], SOURCE_HEAD,
            ["0x10", "      MUFU.EX2 R1, R2 ;", "2", "2", "10"]]
    out = sass_mix(rows)
    fwd = out["cca_attention_fwd_bound"]
    assert fwd["warp_instructions"] == 4 * 2048
    assert fwd["top_opcodes"] == {"FMUL": 4096, "FSETP.GEU.AND": 2048, "MUFU.EX2": 2048}
    assert list(fwd["stall_samples"]) == ["MUFU.EX2", "FSETP.GEU.AND", "FMUL"]  # zero-sample opcodes left out
    assert out["cca_attention_dq"]["top_opcodes"] == {"MUFU.EX2": 10}


def test_sass_mix_rejects_other_pages():
    with pytest.raises(SystemExit, match="Kernel Name"):
        sass_mix([["ID", "Kernel Name"], ["0", "x"]])


def test_sass_mix_without_stall_sampling_counts_no_stalls():
    rows = [["Kernel Name", "k", ""], ["Address", "Source", "Instructions Executed"],
            ["0x10", "  MUFU.EX2 R1, R2 ;", "7"]]
    out = sass_mix(rows)["k"]
    assert out["top_opcodes"] == {"MUFU.EX2": 7} and out["stall_samples"] == {}

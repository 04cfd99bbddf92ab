"""nccl-tests bandwidth conventions and the saturation-point detector on synthetic curves with known answers."""

import numpy as np
import pytest

from benchmarks.systems import collectives
from benchmarks.systems.conventions import algbw, bus_factor, busbw, per_rank_buffers
from benchmarks.systems.saturation import fit_latency_bandwidth, median3, saturation_point


def test_bus_factors_match_nccl_tests():
    # the factors nccl-tests' PERFORMANCE notes derive: 2(n-1)/n, (n-1)/n, 1
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_reduce", 2) == pytest.approx(1.0)
    for name in ("reduce_scatter", "all_gather", "all_to_all"):
        assert bus_factor(name, 8) == pytest.approx(0.875)
        assert bus_factor(name, 1) == 0.0
    assert bus_factor("broadcast", 64) == 1.0
    with pytest.raises(ValueError):
        bus_factor("allreduce", 8)


def test_algbw_and_busbw_of_a_known_measurement():
    # 1 GiB all-reduced over 8 ranks in 4 ms: algbw 268.4 GB/s, busbw 1.75x that
    size, t = 2 ** 30, 4e-3
    assert algbw(size, t) == pytest.approx(268.435456e9)
    assert busbw("all_reduce", 8, size, t) == pytest.approx(1.75 * 268.435456e9)


def test_buffers_per_rank_follow_the_size_convention():
    assert per_rank_buffers("reduce_scatter", 8, 8192) == (8192, 1024)  # size = the input
    assert per_rank_buffers("all_gather", 8, 8192) == (1024, 8192)  # size = the output
    assert per_rank_buffers("all_to_all", 8, 8192) == (8192, 8192)
    # block sizes round so every rank's share is whole, and map back to the logical size
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"):
        elems = collectives.block_elems(name, 8, 4096, 4)
        assert collectives.logical_bytes(name, 8, elems, 4) == 4096
    assert collectives.block_elems("all_to_all", 6, 4096, 4) % 6 == 0


def _alpha_beta_curve(alpha=20e-6, beta=50e9):
    sizes = np.array([2.0 ** k for k in range(10, 34)])
    return sizes, sizes / (alpha + sizes / beta)  # algorithm bandwidth of t = alpha + S / beta


def test_saturation_of_an_alpha_beta_curve_is_at_the_analytic_knee():
    sizes, bw = _alpha_beta_curve()
    sat = saturation_point(sizes, bw, 0.95)
    # on an unbounded ladder bw(S) >= 0.95 beta at S >= 19 alpha beta; the smoothed plateau is the median of the
    # last three points (= the second-to-last), so the knee is the first size reaching 95% of that
    plateau = bw[-2]
    first = sizes[np.argmax(bw >= 0.95 * plateau)]
    assert sat.x == first
    assert 19 * 20e-6 * 50e9 <= sat.x <= 2 * 19 * 20e-6 * 50e9


def test_saturation_ignores_a_lone_spike_and_a_final_dip_but_not_a_real_decline():
    sizes, bw = _alpha_beta_curve()
    clean = saturation_point(sizes, bw, 0.95).x
    spiky = bw.copy()
    spiky[8] *= 3  # one noisy sample far above the plateau
    spiky[-1] *= 0.5  # and the largest message dips
    assert saturation_point(sizes, spiky, 0.95).x == clean
    declining = bw.copy()
    declining[-4:] *= 0.5  # a sustained drop is real: the curve never stays at its plateau
    assert saturation_point(sizes, declining, 0.95).x != clean


def test_saturation_edge_cases():
    assert saturation_point([1, 2, 4], [1.0, 1.0, 1.0], 0.9).x == 1
    assert saturation_point([1, 2, 4], [1.0, 2.0, 4.0], 0.9).x == 4  # short curves are not smoothed
    with pytest.raises(ValueError):
        saturation_point([2, 1], [1.0, 1.0])
    np.testing.assert_allclose(median3([1, 9, 1, 1, 1]), [1, 1, 1, 1, 1])


def test_latency_bandwidth_fit_recovers_alpha_and_beta():
    sizes = np.array([2.0 ** k for k in range(10, 30)])
    times = 15e-6 + sizes / 80e9
    alpha, beta = fit_latency_bandwidth(sizes, times)
    assert alpha == pytest.approx(15e-6, rel=1e-3)
    assert beta == pytest.approx(80e9, rel=1e-3)

from zaya_jax.config import bench, zaya1_8b
from zaya_jax.train.flops import active_matmul_params, flops_per_token, mfu


def test_bench_preset_matches_the_hand_count():
    # bench: 8 layers at ZAYA1-8B widths. Per layer: q 2048*1024, k 2048*256, v 2*2048*128, o 1024*2048
    # = 5,242,880; router 2048*256 + 2*256*256 + 256*17 = 659,712; one expert 3*2048*2048 = 12,582,912.
    per_layer = 5_242_880 + 659_712 + 12_582_912
    head = 262_272 * 2048
    assert active_matmul_params(bench()) == 8 * per_layer + head
    attention = 6 * 4096 * 1024 * 8
    assert flops_per_token(bench(), 4096) == 6 * (8 * per_layer + head) + attention
    assert round(flops_per_token(bench(), 4096) / 1e9, 2) == 4.31  # the reference figure


def test_zaya1_8b_hand_count():
    per_layer = 5_242_880 + 659_712 + 12_582_912
    expected = 6 * (40 * per_layer + 262_272 * 2048) + 6 * 4096 * 1024 * 40
    assert flops_per_token(zaya1_8b(), 4096) == expected
    assert abs(flops_per_token(zaya1_8b(), 4096) / 1e9 - 8.666) < 1e-3


def test_mfu_is_a_ratio_of_achieved_to_peak():
    f = flops_per_token(bench(), 4096)
    assert abs(mfu(1e12 / f, bench(), 4096, 2e12) - 0.5) < 1e-12

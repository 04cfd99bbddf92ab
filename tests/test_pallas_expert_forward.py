"""The fused experts' forward (moe_impl 'fused', pallas_kernels/expert_forward.py; interpret mode on the CPU,
compiled on a GPU) against the unfused kernels and the dense reference: the row gathers, SwiGLU and routing weight
inside the kernels, skip tokens left at zero, no gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import expert_forward as fused
from pallas_kernels.grouped_matmul import GroupedTiling
from zaya_jax import config as zc
from zaya_jax.model.experts import expert_block
from zaya_jax.ops import grouped_matmul as gmm

# 16-row units, 32-row program tiles, 32-wide forward tiles (16 gate + 16 up columns per up program): an expert's
# last tile of either height, several column tiles and contraction steps on CPU-sized inputs
SMALL = GroupedTiling(block_rows=16, program_rows=32, group_rows=2, fwd_n=32, fwd_k=16, fwd_warps=4, fwd_stages=1,
                      dgrad_n=16, dgrad_k=16, dgrad_warps=4, dgrad_stages=1, wgrad_n=16, wgrad_k=16, wgrad_rows=16,
                      wgrad_warps=4, wgrad_stages=1)


def draw(seed, n, E, D, I, dtype):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    index = rng.integers(0, E + 1, n)  # E: the skip class
    index[rng.random(n) < 0.1] = E + 3  # past it: skipped too
    index[index == 1] = 2  # an expert without tokens between busy ones
    weight = jnp.asarray(rng.uniform(0.1, 1.0, n), jnp.float32)
    return normal(n, D), jnp.asarray(index, jnp.int32), weight, normal(E, 2 * I, D) * 0.3, normal(E, D, I) * 0.3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_fused_forward_matches_the_unfused_kernels(dtype):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    E, D, I = 5, 48, 64
    x, index, weight, w_gu, w_down = draw(seed, 150, E, D, I, dtype)

    def run(impl):
        return jax.jit(lambda *a: expert_block(*a, jax.nn.silu, impl=impl, tiling=SMALL))(
            x, index, weight, w_gu.astype(dtype), w_down.astype(dtype))

    got, unfused = run("fused"), run("pallas")
    dense = jax.jit(lambda *a: expert_block(*a, jax.nn.silu, impl="dense"))(
        x.astype(jnp.float32), index, weight, w_gu.astype(jnp.float32), w_down.astype(jnp.float32))
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32)[np.asarray(index) >= E], 0.0)
    err = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
    # bf16: the SwiGLU rounds once here, per op in XLA's fusion: a few bf16 ulps on some rows
    assert err(got, unfused.astype(jnp.float32)) <= (1e-6 if dtype == jnp.float32 else 2e-2), f"seed {seed}"
    assert err(got, dense) <= (1e-5 if dtype == jnp.float32 else 3e-2), f"seed {seed}"


def test_default_tiling_layout_and_every_token_skipped():
    """The platform's default tiling (one unit per program on the CPU) through moe_impl 'fused', and a forward where
    every token skips: all zeros, the output buffer's."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    x, index, weight, w_gu, w_down = draw(seed, 70, 4, 32, 32, jnp.float32)
    f = jax.jit(lambda i: expert_block(x, i, weight, w_gu, w_down, jax.nn.silu, impl="fused"))
    want = expert_block(x, index, weight, w_gu, w_down, jax.nn.silu, impl="dense")
    assert float(jnp.abs(f(index) - want).max() / jnp.abs(want).max()) <= 1e-5, f"seed {seed}"
    assert float(jnp.abs(f(jnp.full_like(index, 4))).max()) == 0.0


def test_widths_that_are_not_whole_tiles_run_the_unfused_kernels(monkeypatch):
    x, index, weight, w_gu, w_down = draw(0, 40, 4, 40, 24, jnp.float32)
    assert not fused.supported(40, 24, jnp.float32)
    run = lambda impl: expert_block(x, index, weight, w_gu, w_down, jax.nn.silu, impl=impl)
    want = run("pallas")
    with monkeypatch.context() as m:
        m.setattr(fused, "expert_forward", None)  # a call would fail
        np.testing.assert_array_equal(run("fused"), want)
    with pytest.raises(ValueError, match="not whole tiles"):
        lay = gmm.tile_layout(index, 4, 16)
        fused.expert_forward(x, lay.src, lay.tile_group, weight, w_gu, w_down, act=jax.nn.silu)


def test_no_gradient_and_training_refuses_it():
    x, index, weight, w_gu, w_down = draw(0, 40, 4, 32, 32, jnp.float32)
    with pytest.raises(ValueError, match="no gradient"):
        jax.grad(lambda x: expert_block(x, index, weight, w_gu, w_down, jax.nn.silu, impl="fused").sum())(x)
    assert zc.tiny(moe_impl="fused").moe_impl == "fused"


@pytest.mark.gpu
def test_fused_forward_compiled_on_gpu():
    """Triton-compiled at ZAYA1-like widths with the default tiling: against the unfused kernels."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    x, index, weight, w_gu, w_down = draw(seed, 3000, 16, 512, 256, jnp.bfloat16)

    def run(impl):
        return jax.jit(lambda *a: expert_block(*a, jax.nn.silu, impl=impl))(x, index, weight, w_gu, w_down)

    got, want = run("fused").astype(jnp.float32), run("pallas").astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(index) >= 16], 0.0)
    assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) <= 2e-2, f"seed {seed}"

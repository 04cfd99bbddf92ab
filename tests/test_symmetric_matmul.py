"""The symmetric Gram kernel: equals X Xᵀ (interpret mode on the CPU; compiled on a GPU), only upper-triangle
tiles are launched, the output is exactly symmetric, and Newton-Schulz / Muon give the same result through it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_kernels.symmetric_matmul import (GramTiling, default_tiling, num_upper_tiles, symmetric_gram,
                                             symmetric_square, tail_split, upper_tile_coords)
from zaya_jax.ops.newton_schulz import (QUINTIC_COEFFS, gram_reference, newton_schulz, newton_schulz_step,
                                        quintic_combination, quintic_matrix)
from zaya_jax.optim.muon import muon

SMALL = GramTiling(tile=32, tile_k=16, num_warps=4, num_stages=1)  # several tiles on CPU-sized inputs
WIDE = GramTiling(tile=16, tile_k=16, num_warps=4, num_stages=1, tile_cols=32)  # 16 x 32 tiles
# 32 x 64 tiles with 8 programs resident: a last partial wave of <= 4 tiles runs as half-height programs.
TAIL = GramTiling(tile=32, tile_k=16, num_warps=4, num_stages=1, tile_cols=64, tail_slots=8)


def fresh(shape, dtype=jnp.float32):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype), seed


def gram_float64(x):
    x = np.asarray(x, np.float64)
    return x @ np.swapaxes(x, -1, -2)  # matmul, not einsum: einsum's float64 loop takes minutes at 2048x4096


def rel(a, ref):
    return np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref)


def test_tile_enumeration_covers_the_upper_triangle_once():
    coords = jax.jit(jax.vmap(upper_tile_coords))
    for rows in (1, 2, 7, 64):
        r, c = coords(jnp.arange(num_upper_tiles(rows)))
        pairs = set(zip(r.tolist(), c.tolist()))
        assert pairs == {(i, j) for j in range(rows) for i in range(j + 1)}


def test_wide_tile_enumeration_covers_the_upper_band_once():
    """Column block c (2 row tiles wide) holds row tiles 0 .. 2c+1: everything above the diagonal plus the two
    tiles that make up the diagonal block."""
    coords = jax.jit(jax.vmap(lambda p: upper_tile_coords(p, 2)))
    for blocks in (1, 2, 5, 32):
        r, c = coords(jnp.arange(num_upper_tiles(blocks, 2)))
        pairs = list(zip(r.tolist(), c.tolist()))
        assert len(pairs) == len(set(pairs))
        assert set(pairs) == {(i, j) for j in range(blocks) for i in range(2 * j + 2)}


def test_tiling_is_validated():
    for bad in (dict(tile=48), dict(tile_k=8), dict(tile=64, tile_cols=32), dict(tile_cols=96),
                dict(tail_slots=-1)):
        with pytest.raises(ValueError, match="GramTiling"):
            GramTiling(**bad)


@pytest.mark.parametrize("shape", [(64, 64), (100, 70), (3, 50, 200), (2, 2, 33, 17), (16, 300)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gram_equals_x_xt_fp32(shape):
    x, seed = fresh(shape)
    got = symmetric_gram(x, tiling=SMALL, interpret=True)
    assert got.shape == shape[:-1] + (shape[-2],) and got.dtype == jnp.float32
    assert rel(got, gram_float64(x)) <= 1e-6, f"seed {seed}"
    np.testing.assert_array_equal(got, jnp.swapaxes(got, -1, -2))  # mirrored tiles: exactly symmetric


@pytest.mark.parametrize("shape", [(96, 40), (2, 70, 50)], ids=lambda s: "x".join(map(str, s)))
def test_wide_tiles_equal_x_xt(shape):
    x, seed = fresh(shape)
    got = np.asarray(symmetric_gram(x, tiling=WIDE, interpret=True), np.float64)
    assert rel(got, gram_float64(x)) <= 1e-6, f"seed {seed}"
    # Outside the 32 x 32 diagonal blocks every value is a mirror: exactly symmetric there.
    m = shape[-2]
    band = (np.arange(m)[:, None] // 32) == (np.arange(m)[None, :] // 32)
    np.testing.assert_array_equal(np.where(band, 0, got), np.where(band, 0, np.swapaxes(got, -1, -2)))


@pytest.mark.parametrize("shape", [(96, 160), (2, 72, 40)], ids=lambda s: "x".join(map(str, s)))
def test_gram_bf16_io_fp32_accumulation(shape):
    x, seed = fresh(shape, jnp.bfloat16)
    got = symmetric_gram(x, tiling=SMALL, interpret=True)
    assert got.dtype == jnp.bfloat16
    ref = gram_float64(x)  # of the bf16 inputs, exactly
    # fp32 accumulation leaves only the final bf16 rounding: <= 2^-9 relative per element.
    assert np.max(np.abs(np.asarray(got, np.float64) - ref) / (np.abs(ref) + 1e-3)) <= 2**-8, f"seed {seed}"


def test_full_grid_baseline_equals_x_xt():
    """upper_only=False (every tile computed, nothing mirrored) is the benchmark's plain-GEMM baseline."""
    x, seed = fresh((2, 100, 70))
    full = GramTiling(tile=32, tile_k=16, num_warps=4, num_stages=1, upper_only=False)
    assert rel(symmetric_gram(x, tiling=full, interpret=True), gram_float64(x)) <= 1e-6, f"seed {seed}"


def test_only_upper_triangle_programs_are_launched():
    x, _ = fresh((2, 100, 70))
    jaxpr = jax.make_jaxpr(lambda x: symmetric_gram(x, tiling=SMALL, interpret=True))(x)

    def grids(jaxpr):  # pallas_call grids anywhere in the program (it sits inside the jit of symmetric_gram)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["grid_mapping"].grid
                continue
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from grids(inner)

    # 100 rows pad to 4 tiles of 32: 10 upper-triangle tiles (of 16) per matrix, 2 matrices.
    assert list(grids(jaxpr.jaxpr)) == [(20,)]
    # Wide 16 x 32 tiles: 100 rows pad to 4 column blocks of 32, holding 2, 4, 6, 8 row tiles of 16.
    jaxpr = jax.make_jaxpr(lambda x: symmetric_gram(x, tiling=WIDE, interpret=True))(x)
    assert list(grids(jaxpr.jaxpr)) == [(40,)]
    # 32 x 64 tiles: 100 rows pad to 2 column blocks holding 2 and 4 row tiles (6 per matrix, 12 in all); 8
    # resident programs leave 4 for the last wave, split in halves: 8 whole + 8 halves.
    jaxpr = jax.make_jaxpr(lambda x: symmetric_gram(x, tiling=TAIL, interpret=True))(x)
    assert list(grids(jaxpr.jaxpr)) == [(16,)]


def test_tail_split_only_shortens_a_last_wave_of_at_most_half():
    assert tail_split(576, 132, 128) == 48  # 8 x 2048² in 128 x 256 tiles on an H200: 4 waves + 48
    assert tail_split(1152, 132, 128) == 0  # 8 waves + 96: halves (192) would not fit one wave
    assert tail_split(528, 132, 128) == 0  # whole waves
    assert tail_split(40, 132, 128) == 0  # a single partial wave: nothing to gain
    assert tail_split(576, 0, 128) == 0 and tail_split(576, 132, 16) == 0  # off; halves below Triton's 16 rows


def test_split_tail_equals_x_xt_and_the_fused_epilogue():
    """Half-height tail programs (the last matrix's last 4 tiles: 2 mirrored, 2 of the diagonal block) give the
    same Gram matrix and the same a I + b A + c A·A (2 x 70 rows: 12 tiles, 8 programs resident)."""
    x, seed = fresh((2, 70, 50))
    got = symmetric_gram(x, tiling=TAIL, interpret=True)
    assert rel(got, gram_float64(x)) <= 1e-6, f"seed {seed}"
    y, seed = fresh((2, 70, 70))
    a = y + jnp.swapaxes(y, -1, -2)
    fused = symmetric_gram(a, a, alpha=2.0315, beta=-4.775, diag=3.4445, tiling=TAIL, interpret=True)
    a64 = np.asarray(a, np.float64)
    assert rel(fused, 2.0315 * a64 @ a64 - 4.775 * a64 + 3.4445 * np.eye(70)) <= 1e-6, f"seed {seed}"


def test_symmetric_square_equals_a_times_a():
    x, seed = fresh((2, 80, 80))
    a = x + jnp.swapaxes(x, -1, -2)
    ref = np.einsum("bij,bjk->bik", np.asarray(a, np.float64), np.asarray(a, np.float64))
    assert rel(symmetric_square(a, tiling=SMALL, interpret=True), ref) <= 1e-6, f"seed {seed}"
    with pytest.raises(ValueError, match="square"):
        symmetric_square(x[:, :, :40])


@pytest.mark.parametrize("shape", [(2, 70, 70), (96, 96)], ids=lambda s: "x".join(map(str, s)))
def test_fused_epilogue_adds_a_symmetric_matrix(shape):
    x, seed = fresh(shape)
    a = x + jnp.swapaxes(x, -1, -2)
    got = symmetric_gram(a, a, alpha=2.0315, beta=-4.775, tiling=SMALL, interpret=True)
    a64 = np.asarray(a, np.float64)
    want = 2.0315 * np.einsum("...ij,...kj->...ik", a64, a64) - 4.775 * a64
    assert rel(got, want) <= 1e-6, f"seed {seed}"
    with pytest.raises(ValueError, match="addend"):
        symmetric_gram(a, a[..., :10, :10])


@pytest.mark.parametrize("tiling", [SMALL, WIDE], ids=["square", "wide"])
def test_fused_epilogue_adds_a_diagonal(tiling):
    """B = a I + b A + c A·A in one kernel (Newton-Schulz's folded step); 70 rows: padded, diag cut back."""
    x, seed = fresh((2, 70, 70))
    a = x + jnp.swapaxes(x, -1, -2)
    got = symmetric_gram(a, a, alpha=2.0315, beta=-4.775, diag=3.4445, tiling=tiling, interpret=True)
    a64 = np.asarray(a, np.float64)
    want = 2.0315 * a64 @ a64 - 4.775 * a64 + 3.4445 * np.eye(70)
    assert rel(got, want) <= 1e-6, f"seed {seed}"


def test_quintic_matrix_and_step_kernel_equal_xla():
    x, seed = fresh((2, 64, 96), jnp.bfloat16)
    a = gram_reference(x)
    want = quintic_matrix(a, QUINTIC_COEFFS)
    got = quintic_matrix(a, QUINTIC_COEFFS, impl="pallas")
    assert got.dtype == jnp.bfloat16
    assert rel(got, np.asarray(want, np.float64)) <= 1e-2, f"seed {seed}"
    step = newton_schulz_step(x, gram_impl="pallas", tiling=WIDE)
    assert step.dtype == jnp.bfloat16 and step.shape == x.shape
    assert rel(step, np.asarray(newton_schulz_step(x), np.float64)) <= 1e-2, f"seed {seed}"


def test_quintic_combination_kernel_equals_xla():
    x, seed = fresh((3, 64, 64), jnp.bfloat16)
    a = gram_reference(x)
    want = quintic_combination(a, -4.775, 2.0315)
    got = quintic_combination(a, -4.775, 2.0315, impl="pallas")
    assert got.dtype == jnp.bfloat16
    assert rel(got, np.asarray(want, np.float64)) <= 1e-2, f"seed {seed}"


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_newton_schulz_through_the_kernel_equals_xla(dtype, tol):
    """Against the fp32 XLA iteration (itself within 1e-5 of float64, see test_muon): the bf16 tolerance is the
    same as the one for bf16 XLA."""
    x, seed = fresh((2, 48, 96))
    reference = np.asarray(newton_schulz(x, dtype=jnp.float32), np.float64)
    via_kernel = newton_schulz(x, dtype=dtype, gram_impl="pallas")  # interpret mode on the CPU
    assert rel(via_kernel, reference) <= tol, f"seed {seed}"


def test_muon_with_the_kernel_equals_muon_with_xla():
    params = {"w": fresh((2, 40, 64))[0]}
    grads = {"w": fresh((2, 40, 64))[0]}
    updates = {}
    for impl in ("xla", "pallas"):
        tx = muon(0.1, weight_decay=0.1, ns_dtype="float32", gram_impl=impl)
        updates[impl], _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["pallas"]["w"], updates["xla"]["w"], rtol=1e-4, atol=1e-6)


def test_sharded_stack_runs_per_device_without_gathering():
    """Stacked matrices sharded over a batch dim under jit: each device runs the kernel on its own matrices (no
    collective in the compiled program) and the result keeps the sharding; a sharded matrix dim is gathered
    (each matrix must be whole on one device) and still gives X Xᵀ."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x, seed = fresh((4, 2, 48, 40))
    want = gram_float64(x)
    step = jax.jit(lambda x: symmetric_gram(x, tiling=SMALL, interpret=True))
    fused = jax.jit(lambda x: symmetric_gram(x, x @ jnp.swapaxes(x, -1, -2), beta=0.0, tiling=SMALL, interpret=True))
    batch_sharded = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    for fn in (step, fused):
        hlo = fn.lower(batch_sharded).compile().as_text()
        assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
        got = fn(batch_sharded)
        assert got.sharding.is_equivalent_to(batch_sharded.sharding, 4)
        assert rel(got, want) <= 1e-6, f"seed {seed}"
    rows_sharded = jax.device_put(x, NamedSharding(mesh, P(None, None, "data")))
    assert rel(step(rows_sharded), want) <= 1e-6, f"seed {seed}"


# ---- compiled Triton kernel (run with ZAYA_TEST_GPU=1 -m gpu on a GPU) ----------------------------------------

GPU_SHAPES = [(2048, 2048), (2048, 4096), (1024, 2048), (3, 384, 200)]  # X [.., m, k] as NS sees them


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compiled_kernel_equals_xla_on_gpu(shape, dtype):
    x, seed = fresh(shape, dtype)
    got = symmetric_gram(x)
    want = gram_reference(x)
    ref = gram_float64(x)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel(got, ref) <= tol, f"kernel rel err {rel(got, ref):.2e} (seed {seed})"
    assert rel(got, ref) <= 1.5 * rel(want, ref) + 1e-6, "kernel worse than XLA"
    # Mirrored (off-diagonal) tiles are exact transposes; inside a diagonal tile the MMA's summation order may
    # differ between (i, j) and (j, i), so those agree to rounding.
    tile = default_tiling(dtype).cols  # the diagonal blocks (tile_cols wide) are computed, not mirrored
    m = shape[-2]
    diagonal = (np.arange(m)[:, None] // tile) == (np.arange(m)[None, :] // tile)
    got, got_t = np.asarray(got, np.float64), np.swapaxes(np.asarray(got, np.float64), -1, -2)
    np.testing.assert_array_equal(np.where(diagonal, 0, got), np.where(diagonal, 0, got_t))
    np.testing.assert_allclose(got, got_t, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.gpu
def test_compiled_fused_epilogue_on_gpu():
    x, seed = fresh((4, 2048, 2048))
    a = gram_reference(x / 64).astype(jnp.bfloat16)
    got = quintic_combination(a, -4.775, 2.0315, impl="pallas")
    want = quintic_combination(a.astype(jnp.float32), -4.775, 2.0315)
    assert rel(got, np.asarray(want, np.float64)) <= 1e-2, f"seed {seed}"


@pytest.mark.gpu
def test_compiled_newton_schulz_equals_xla_on_gpu():
    x, seed = fresh((4, 1024, 2048))
    via_kernel = jax.jit(lambda x: newton_schulz(x, gram_impl="pallas"))(x)
    reference = jax.jit(lambda x: newton_schulz(x, dtype=jnp.float32))(x)
    assert rel(via_kernel, np.asarray(reference, np.float64)) <= 2e-2, f"seed {seed}"


@pytest.mark.gpu
def test_compiled_newton_schulz_inside_shard_map_on_gpu():
    """ZeRO-1 runs Newton-Schulz inside shard_map (check_vma on): the kernel's output must carry the varying mesh
    axes (interpret mode cannot run this: its evaluator rejects the kernel's unvarying loop indices)."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    x, seed = fresh((2 * jax.device_count(), 256, 512))
    ns = jax.jit(jax.shard_map(lambda v: newton_schulz(v, gram_impl="pallas"), mesh=mesh, in_specs=P("data"),
                               out_specs=P("data")))
    got = ns(jax.device_put(x, NamedSharding(mesh, P("data"))))
    want = jax.jit(lambda x: newton_schulz(x, dtype=jnp.float32))(x)
    assert rel(got, np.asarray(want, np.float64)) <= 2e-2, f"seed {seed}"


@pytest.mark.gpu
def test_compiled_split_tail_on_gpu():
    """The H200 case of the split tail: 8 x 2048² in 128 x 256 tiles = 576 tiles on 132 SMs, the last 48 as 96
    half-height programs (a second, smaller MMA loop in the same Triton kernel); Gram and fused epilogue."""
    tiling = GramTiling(128, 64, 8, 3, tile_cols=256, tail_slots=132)
    x, seed = fresh((8, 2048, 2048), jnp.bfloat16)
    x = x / 64
    got = symmetric_gram(x, tiling=tiling)
    assert rel(got, gram_float64(x)) <= 1e-2, f"seed {seed}"
    a = gram_reference(x)
    fused = quintic_matrix(a, QUINTIC_COEFFS, impl="pallas", tiling=tiling)
    want = quintic_matrix(a.astype(jnp.float32), QUINTIC_COEFFS)
    assert rel(fused, np.asarray(want, np.float64)) <= 1e-2, f"seed {seed}"

"""The MoE grouped-GEMM kernels (interpret mode on the CPU; compiled on a GPU): the tile-padded layout, forward,
dgrad and wgrad against the jnp reference, the custom VJP, and the experts with moe_impl='pallas' against 'ragged'
(the whole model with every kernel: tests/test_pallas_model.py)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import _grouped_kernels as kern
from pallas_kernels.grouped_matmul import (
    GroupedTiling,
    default_tiling,
    group_tiles,
    grouped_matmul,
    grouped_wgrad_sum,
    program_tiles,
)
from zaya_jax import config as zc
from zaya_jax.model.experts import Experts
from zaya_jax.ops import grouped_matmul as gmm

# 16-row units, 32-row program tiles (an expert's last tile is 16 or 32 rows), 16-wide blocks: several tiles and K
# steps on CPU-sized inputs
SMALL = GroupedTiling(block_rows=16, program_rows=32, group_rows=2, fwd_n=16, fwd_k=16, fwd_warps=4, fwd_stages=1,
                      dgrad_n=16, dgrad_k=16, dgrad_warps=4, dgrad_stages=1, wgrad_n=16, wgrad_k=16, wgrad_rows=16,
                      wgrad_warps=4, wgrad_stages=1)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rng_and_seed():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return np.random.default_rng(seed), seed


def normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def routing(rng, kind: str, n: int, E: int):
    """index [N] in [0, E] (E = skip) of a named routing pattern."""
    if kind == "mixed":  # random, ~10% skip, expert 1 never chosen (an empty group between non-empty ones)
        idx = rng.choice(np.array([e for e in range(E) if e != 1]), n)
        idx[rng.random(n) < 0.1] = E
    elif kind == "one_expert":
        idx = np.full(n, E - 1)
    elif kind == "all_skip":
        idx = np.full(n, E)
    else:
        raise ValueError(kind)
    return jnp.asarray(idx, jnp.int32)


def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30)


def per_token(x, w, index):
    """y[n] = x[n] @ w[index[n]]ᵀ, zero for skip tokens, in float64 (the definition, without any layout)."""
    x, w, index = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(index)
    E = w.shape[0]
    y = np.einsum("nd,nod->no", x, w[np.minimum(index, E - 1)])
    return np.where((index < E)[:, None], y, 0.0)


# ------------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("kind", ["mixed", "one_expert", "all_skip"])
def test_layout_tiles_hold_one_group_and_the_gathers_invert(kind):
    rng, seed = rng_and_seed()
    n, E, bm = 53, 5, 16
    index = routing(rng, kind, n, E)
    lay = jax.jit(gmm.tile_layout, static_argnums=(1, 2))(index, E, bm)
    src, dst, tg = map(np.asarray, lay)
    idx = np.asarray(index)
    n_pad = gmm.padded_rows(n, E, bm)
    assert src.shape == (n_pad,) and dst.shape == (n,) and tg.shape == (n_pad // bm,)
    assert np.all(np.diff(tg) >= 0) and tg.min() >= 0 and tg.max() <= E, f"seed {seed}"
    routed = idx < E
    assert np.all(dst[~routed] == n_pad)
    assert np.all(tg[dst[routed] // bm] == idx[routed]), f"seed {seed}: a token sits in another group's tile"
    assert np.all(src[dst[routed]] == np.nonzero(routed)[0])
    assert np.sum(src < n) == routed.sum() and np.all(src[src >= n] == n)
    # tokens keep their order inside a group (a stable sort), and each group starts on a fresh tile
    for e in range(E):
        rows = dst[idx == e]
        assert np.all(np.diff(rows) == 1) and (rows.size == 0 or rows[0] % bm == 0)
    start, count = map(np.asarray, group_tiles(jnp.asarray(tg), E))
    np.testing.assert_array_equal(count, -(-np.bincount(idx, minlength=E + 1)[:E] // bm))
    np.testing.assert_array_equal(start, np.cumsum(count) - count)


def test_gather_rows_backward_is_the_inverse_gather():
    rng, seed = rng_and_seed()
    n, E, bm, d = 29, 3, 16, 8
    index = routing(rng, "mixed", n, E)
    lay = gmm.tile_layout(index, E, bm)
    x = normal(rng, (n, d), jnp.float32)
    xs, pull = jax.vjp(lambda x: gmm.gather_rows(x, lay.src, lay.dst), x)
    ct = normal(rng, xs.shape, jnp.float32)
    # the transpose of the gather by src, written as the scatter-add it would otherwise be
    want = jnp.zeros((n + 1, d)).at[lay.src].add(ct)[:n]
    np.testing.assert_allclose(pull(ct)[0], want, rtol=0, atol=0, err_msg=f"seed {seed}")


# ------------------------------------------------------------------------------------------------ the kernels
CASES = [("mixed", 53, 5, 24, 40), ("one_expert", 37, 3, 48, 32), ("all_skip", 20, 3, 16, 16)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,n,E,d_in,d_out", CASES, ids=[c[0] for c in CASES])
def test_forward_dgrad_wgrad_match_reference(kind, n, E, d_in, d_out, dtype):
    """The custom VJP's three kernels against the reference and its autodiff. d_in/d_out are not multiples of
    the 16-wide blocks in the mixed case (padded inside); group sizes include zeros and non-multiples of 16."""
    rng, seed = rng_and_seed()
    index = routing(rng, kind, n, E)
    lay = gmm.tile_layout(index, E, SMALL.block_rows)
    x = gmm.gather_rows(normal(rng, (n, d_in), dtype), lay.src, lay.dst)
    w = normal(rng, (E, d_out, d_in), dtype)
    dy = normal(rng, (x.shape[0], d_out), dtype)

    y, pull = jax.vjp(lambda x, w: grouped_matmul(x, w, lay.tile_group, tiling=SMALL, interpret=True), x, w)
    dx, dw = pull(dy)
    up = lambda a: a.astype(jnp.float32)  # reference in fp32 from the same (bf16) values
    y_ref, pull_ref = jax.vjp(lambda x, w: gmm.grouped_matmul_reference(x, w, lay.tile_group), up(x), up(w))
    dx_ref, dw_ref = pull_ref(up(dy))
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert y.shape == (x.shape[0], d_out) and dx.shape == x.shape and dw.shape == w.shape
    tol = TOL[dtype]
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        if not np.any(np.asarray(want)):  # all tokens skipped: exact zeros
            np.testing.assert_array_equal(np.asarray(got, np.float32), 0.0, err_msg=f"{name}, seed {seed}")
        else:
            assert rel(got, want) <= tol, f"{name} rel err {rel(got, want):.2e}, seed {seed}"
    # the layout round trip gives each token its own expert's product (and zeros for skip tokens)
    tok = gmm.gather_rows(y, lay.dst, lay.src)
    if kind != "all_skip":
        assert rel(tok, per_token(up(gmm.gather_rows(x, lay.dst, lay.src)), up(w), index)) <= tol, f"seed {seed}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,n,E,d_in,d_out", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_rows_read_in_place_equal_the_gathered_copy(kind, n, E, d_in, d_out, dtype):
    """Given the layout's maps, the forward reads token rows in place (no gathered copy): the same values as the
    kernel on gather_rows' copy, bit for bit, and the same gradients to the tokens and the weights."""
    rng, seed = rng_and_seed()
    index = routing(rng, kind, n, E)
    lay = gmm.tile_layout(index, E, SMALL.block_rows)
    x = normal(rng, (n, d_in), dtype)
    w = normal(rng, (E, d_out, d_in), dtype)
    dy = normal(rng, (lay.src.shape[0], d_out), dtype)
    in_place = lambda x, w: grouped_matmul(x, w, lay.tile_group, tiling=SMALL, interpret=True, src=lay.src,
                                           dst=lay.dst)
    copied = lambda x, w: grouped_matmul(gmm.gather_rows(x, lay.src, lay.dst), w, lay.tile_group, tiling=SMALL,
                                         interpret=True)
    (y, pull), (y_ref, pull_ref) = jax.vjp(in_place, x, w), jax.vjp(copied, x, w)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), err_msg=f"seed {seed}")
    for name, got, want in zip(("dx", "dw"), pull(dy), pull_ref(dy)):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      err_msg=f"{name}, seed {seed}")
    with pytest.raises(ValueError, match="both maps"):
        grouped_matmul(x, w, lay.tile_group, tiling=SMALL, interpret=True, src=lay.src)


def test_program_tiles_cover_every_unit_once_within_one_group():
    """Random routings (uneven groups, empty ones, skips, sometimes every token skipped) of 90 tokens over 5 experts."""
    rng, seed = rng_and_seed()
    E, n = 5, 90

    @functools.partial(jax.jit, static_argnums=1)
    def tables(index, span):
        tg = gmm.tile_layout(index, E, 16).tile_group
        return tg, program_tiles(tg, E, span)

    for draw in range(30):
        span = (1, 2, 3)[draw % 3]
        popularity = rng.dirichlet(np.full(E + 1, 0.5)) if draw % 10 else np.eye(E + 1)[E]
        tg, tiles = tables(jnp.asarray(rng.choice(E + 1, n, p=popularity), jnp.int32), span)
        tg, (first, group, units) = np.asarray(tg), np.asarray(tiles)
        assert first.size == -(-tg.size // span) + E and np.all((units >= 0) & (units <= span)), f"seed {seed}"
        covered = np.zeros(tg.size, int)
        for f, g, u in zip(first, group, units):
            covered[f:f + u] += 1
            assert np.all(tg[f:f + u] == g), f"seed {seed}: a program tile straddles groups"
        np.testing.assert_array_equal(covered, 1, err_msg=f"seed {seed}")
        busy = group < E  # only a group's last tile is short
        tiles_per_group = np.bincount(group[busy], minlength=E)
        np.testing.assert_array_equal(tiles_per_group, -(-np.bincount(tg, minlength=E + 1)[:E] // span))


@pytest.mark.parametrize("span", [1, 2])
def test_dgrad_kernel_contracts_the_output_axis(span):
    """rows_matmul 'nn' alone: x [M, out] @ w[g] [out, in] per unit, idle units zero (here 2 idle units); with span
    2 group 0 runs as one 2-unit tile and group 2 as a 2-unit tile and a 1-unit tail."""
    rng, seed = rng_and_seed()
    E, bm, d_out, d_in = 3, 16, 32, 48
    tile_group = jnp.asarray([0, 0, 2, 2, 2, 3, 3], jnp.int32)  # group 1 empty, last two units idle
    x = normal(rng, (7 * bm, d_out), jnp.float32)
    w = normal(rng, (E, d_out, d_in), jnp.float32)
    got = kern.rows_matmul(x, w, program_tiles(tile_group, E, span), transpose_w=False, block_rows=bm, span=span,
                           block_n=16, block_k=16, group_rows=2, num_warps=4, num_stages=1, interpret=True)
    g = np.repeat(np.asarray(tile_group), bm)
    want = np.where((g < E)[:, None], np.einsum("mo,moi->mi", np.asarray(x, np.float64),
                                                np.asarray(w, np.float64)[np.minimum(g, E - 1)]), 0.0)
    assert rel(got, want) <= 1e-6, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(got)[5 * bm:], 0.0)


def test_wgrad_kernel_sums_each_groups_rows_and_zeroes_empty_groups():
    rng, seed = rng_and_seed()
    E, bm, d_out, d_in = 4, 16, 32, 16
    tile_group = jnp.asarray([0, 2, 2, 2, 4], jnp.int32)  # groups 1 and 3 empty, one idle tile
    start, count = group_tiles(tile_group, E)
    dy = normal(rng, (5 * bm, d_out), jnp.float32)
    x = normal(rng, (5 * bm, d_in), jnp.float32)
    got = kern.group_wgrad([dy], [x], start[None], count[None], block_rows=bm, block_n=16, block_k=16,
                           rows_step=8 * 2, num_warps=4, num_stages=1, interpret=True)
    g = np.repeat(np.asarray(tile_group), bm)
    dy64, x64 = np.asarray(dy, np.float64), np.asarray(x, np.float64)
    want = np.stack([dy64[g == e].T @ x64[g == e] for e in range(E)])
    assert rel(got, want) <= 1e-6, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(got)[[1, 3]], 0.0)


def test_wgrad_sum_adds_every_parts_expert_gradients_to_the_fp32_total():
    """Three microbatches on their own routings (one with an expert none of the others use, one all skipped): the
    summed kernel adds to `total` what the per-microbatch weight gradients of grouped_matmul add up to."""
    rng, seed = rng_and_seed()
    E, n, d_in, d_out = 4, 40, 32, 48
    total = normal(rng, (E, d_out, d_in), jnp.float32)
    xs, dys, groups, want = [], [], [], np.asarray(total, np.float64)
    for kind in ("mixed", "one_expert", "all_skip"):
        lay = gmm.tile_layout(routing(rng, kind, n, E), E, SMALL.block_rows)
        x = gmm.gather_rows(normal(rng, (n, d_in), jnp.bfloat16), lay.src, lay.dst)
        dy = gmm.gather_rows(normal(rng, (n, d_out), jnp.bfloat16), lay.src, lay.dst)
        w = jnp.zeros((E, d_out, d_in), jnp.bfloat16)
        _, pull = jax.vjp(lambda w: grouped_matmul(x, w, lay.tile_group, tiling=SMALL, interpret=True), w)
        want = want + np.asarray(pull(dy)[0], np.float64)  # (each rounded to bf16; the sum below is not)
        xs.append(x), dys.append(dy), groups.append(lay.tile_group)
    got = grouped_wgrad_sum(total, dys, xs, groups, tiling=SMALL, interpret=True)
    assert got.dtype == jnp.float32 and got.shape == total.shape
    assert rel(got, want) <= 1e-2, f"seed {seed}"
    exact = np.asarray(total, np.float64) + sum(
        np.stack([np.asarray(d, np.float64)[np.repeat(np.asarray(g), SMALL.block_rows) == e].T
                  @ np.asarray(x, np.float64)[np.repeat(np.asarray(g), SMALL.block_rows) == e] for e in range(E)])
        for d, x, g in zip(dys, xs, groups))
    assert rel(got, exact) <= 1e-6, f"seed {seed}"  # one fp32 sum: no per-microbatch rounding


def test_bad_inputs_raise_clear_errors():
    x = jnp.zeros((32, 8))
    with pytest.raises(ValueError, match="input features"):
        grouped_matmul(x, jnp.zeros((2, 4, 9)), jnp.zeros((2,), jnp.int32), tiling=SMALL, interpret=True)
    with pytest.raises(ValueError, match="whole tiles"):
        grouped_matmul(x, jnp.zeros((2, 4, 8)), jnp.zeros((3,), jnp.int32), tiling=SMALL, interpret=True)
    with pytest.raises(ValueError, match="compute dtype"):
        grouped_matmul(x, jnp.zeros((2, 4, 8), jnp.bfloat16), jnp.zeros((2,), jnp.int32), tiling=SMALL,
                       interpret=True)
    with pytest.raises(ValueError, match="as many dys"):
        grouped_wgrad_sum(jnp.zeros((2, 4, 8)), [jnp.zeros((32, 4))], [], [jnp.zeros((2,), jnp.int32)], tiling=SMALL,
                          interpret=True)
    with pytest.raises(ValueError, match="unknown impl"):
        gmm.grouped_matmul(x, jnp.zeros((2, 4, 8)), jnp.zeros((2,), jnp.int32), impl="cuda")


# ---------------------------------------------------------------------------------------- experts and model
def _experts_out_and_grads(cfg, x, index, weight):
    module = Experts(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(module, nnx.Param)

    def loss(params, x, weight):
        out = nnx.merge(graphdef, params)(x, index, weight)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, x, weight)
    return out, grads


def test_experts_pallas_matches_ragged_with_skip_tokens():
    """Routing weight, skip class (index E and beyond) and gradients to x, weights and routing weights."""
    rng, seed = rng_and_seed()
    cfg = zc.tiny(dtype="float32", hidden_size=40, moe_intermediate_size=24, num_experts=4)
    n, E = 45, cfg.num_experts
    index = routing(rng, "mixed", n, E).at[:3].set(E + 2)  # out-of-range classes count as skip too
    x = normal(rng, (n, cfg.hidden_size), jnp.float32)
    weight = jnp.asarray(rng.random(n), jnp.float32)
    want, want_grads = _experts_out_and_grads(cfg.replace(moe_impl="ragged"), x, index, weight)
    got, got_grads = _experts_out_and_grads(cfg.replace(moe_impl="pallas"), x, index, weight)
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(index) >= E], 0.0)
    assert rel(got, want) <= 1e-5, f"seed {seed}"
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert rel(a, b) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("n", [4, 24], ids=["per_token", "dense"])
def test_decode_experts_match_the_reference(n):
    """moe_impl 'decode': at most E / 2 tokens gather their own expert's weights, more run every expert on every
    token; neither traces a grouped GEMM. Skip tokens give zeros; values and gradients as the dense reference's."""
    from zaya_jax.model.experts import expert_block
    rng, seed = rng_and_seed()
    E, D, I = 8, 48, 40
    x, w_gu, w_down = (normal(rng, shape, jnp.float32) for shape in ((n, D), (E, 2 * I, D), (E, D, I)))
    index = jnp.asarray(rng.integers(0, E + 1, n), jnp.int32).at[0].set(E)  # one skip token at least
    weight = jnp.asarray(rng.uniform(0.2, 1.0, n), jnp.float32)

    def out(impl):
        return lambda x, a, b: expert_block(x, index, weight, a, b, jax.nn.silu, impl=impl)

    text = jax.jit(out("decode")).lower(x, w_gu, w_down).as_text()
    assert "ragged_dot" not in text and ("gather" in text) == (n <= E // 2)
    got, pull = jax.vjp(out("decode"), x, w_gu, w_down)
    want, pull_ref = jax.vjp(out("ragged"), x, w_gu, w_down)
    assert float(jnp.abs(got[0]).max()) == 0.0
    dy = normal(rng, got.shape, jnp.float32)
    for name, a, b in zip(("y", "dx", "dw_gu", "dw_down"), (got, *pull(dy)), (want, *pull_ref(dy))):
        assert rel(a, b) <= 1e-5, f"{name}: rel err {rel(a, b):.2e}, seed {seed}"


def test_config_accepts_pallas_and_rejects_unknown_moe_impl():
    assert zc.tiny(moe_impl="pallas").moe_impl == "pallas" and zc.tiny(moe_impl="decode").moe_impl == "decode"
    with pytest.raises(zc.ConfigError, match="moe_impl"):
        zc.tiny(moe_impl="megablocks")


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compiled_kernels_match_reference_on_gpu(dtype):
    """Default tilings, compiled by Triton: a routing with an empty expert and skip tokens, widths that need no
    padding (ZAYA1's) and one that does."""
    rng, seed = rng_and_seed()
    n, E = 3000, 8
    index = routing(rng, "mixed", n, E)
    lay = gmm.tile_layout(index, E, default_tiling(dtype).block_rows)
    for d_in, d_out in ((512, 1024), (320, 200)):
        x = gmm.gather_rows(normal(rng, (n, d_in), dtype), lay.src, lay.dst)
        w = normal(rng, (E, d_out, d_in), dtype)
        dy = normal(rng, (x.shape[0], d_out), dtype)
        y, pull = jax.vjp(lambda x, w: grouped_matmul(x, w, lay.tile_group), x, w)
        dx, dw = pull(dy)
        up = lambda a: a.astype(jnp.float32)
        y_ref, pull_ref = jax.vjp(lambda x, w: gmm.grouped_matmul_reference(x, w, lay.tile_group), up(x), up(w))
        for name, got, want in zip(("y", "dx", "dw"), (y, dx, dw), (y_ref, *pull_ref(up(dy)))):
            assert rel(got, want) <= TOL[dtype], f"{name} {d_in}x{d_out} rel err {rel(got, want):.2e}, seed {seed}"


@pytest.mark.gpu
def test_expert_block_inside_shard_map_on_gpu():
    """Inside shard_map (check_vma) with replicated (invariant) weights: the kernels' inputs are made varying and
    the weight gradients summed back, as autodiff does for ordinary primitives (interpret mode cannot run this)."""
    from jax.sharding import PartitionSpec as P

    from zaya_jax.model.experts import expert_block
    rng, seed = rng_and_seed()
    n, E, D, I = 1000, 8, 256, 128
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    x, wgu, wd = normal(rng, (n, D), jnp.bfloat16), normal(rng, (E, 2 * I, D), jnp.bfloat16), normal(
        rng, (E, D, I), jnp.bfloat16)
    index, weight = routing(rng, "mixed", n, E), jnp.asarray(rng.random(n), jnp.float32)

    def grads(impl, x, index, weight, wgu, wd):
        def f(x, wgu, wd):
            out = expert_block(x, index, weight, wgu, wd, jax.nn.silu, impl=impl)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return jax.grad(f, argnums=(0, 1, 2))(x, wgu, wd)

    inside = jax.jit(jax.shard_map(functools.partial(grads, "pallas"), mesh=mesh,
                                   in_specs=(P("data"), P("data"), P("data"), P(), P()),
                                   out_specs=(P("data"), P(), P())))(x, index, weight, wgu, wd)
    outside = jax.jit(functools.partial(grads, "ragged"))(x, index, weight, wgu, wd)
    for got, want in zip(inside, outside):
        assert rel(got, want) <= 2e-2, f"seed {seed}"


def test_expert_block_lowers_for_cuda_inside_shard_map(monkeypatch):
    """Tokens split over 8 devices, replicated weights: the kernels type-check under check_vma and the weight
    gradients are summed over the data axis (one all-reduce each), lowered for CUDA on this CPU."""
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import platform, vma
    from zaya_jax.model.experts import expert_block
    monkeypatch.setattr(platform, "interpret", lambda: False)
    rng, _ = rng_and_seed()
    n, E, D, I = 8 * 64, 4, 64, 32
    x, wgu, wd = normal(rng, (n, D), jnp.bfloat16), normal(rng, (E, 2 * I, D), jnp.bfloat16), normal(
        rng, (E, D, I), jnp.bfloat16)
    index, weight = routing(rng, "mixed", n, E), jnp.asarray(rng.random(n), jnp.float32)

    def grads(x, index, weight, wgu, wd):
        def f(x, wgu, wd):
            return jnp.sum(expert_block(x, index, weight, wgu, wd, jax.nn.silu, impl="pallas").astype(jnp.float32))
        return jax.grad(f, argnums=(0, 1, 2))(x, wgu, wd)

    rows = P("data")
    text = vma.lower_in_shard_map_for_cuda(grads, (x, index, weight, wgu, wd), in_specs=(rows, rows, rows, P(), P()),
                                            out_specs=(rows, P(), P()))
    # the down GEMM's forward output is dead under this loss (its cotangent does not depend on it)
    assert re.findall(r'name = "(grouped_matmul_\w+)"', text) == [
        "grouped_matmul_nt_gathered", "grouped_matmul_nn", "grouped_matmul_wgrad", "grouped_matmul_nn",
        "grouped_matmul_wgrad"]
    assert text.count("stablehlo.all_reduce") == 2  # d(gate_up), d(down) summed over the data axis


@pytest.mark.gpu
def test_deferred_expert_gradients_compiled_on_gpu():
    """The deferred path compiled by Triton: each microbatch's expert block differentiated at DeferredWgrad weights
    (the taps hand over input rows, output gradients and tiles), one summed kernel per weight; against the plain
    per-microbatch weight gradients (bf16-rounded each) and the exact fp32 sum of the same products."""
    from zaya_jax.model.experts import expert_block
    rng, seed = rng_and_seed()
    n, E, D, I = 3000, 8, 512, 256
    wgu, wd = normal(rng, (E, 2 * I, D), jnp.bfloat16), normal(rng, (E, D, I), jnp.bfloat16)
    bm = default_tiling(jnp.bfloat16).block_rows

    def loss(x, index, weight, wgu, wd):
        out = expert_block(x, index, weight, wgu, wd, jax.nn.silu, impl="pallas")
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    grad = jax.jit(jax.grad(loss, argnums=(3, 4)))
    totals = [jnp.zeros(w.shape, jnp.float32) for w in (wgu, wd)]
    plain = [np.zeros(w.shape) for w in (wgu, wd)]
    taps = [[], []]
    for _ in range(3):
        x, index = normal(rng, (n, D), jnp.bfloat16), routing(rng, "mixed", n, E)
        weight = jnp.asarray(rng.random(n), jnp.float32)
        for acc, g in zip(plain, grad(x, index, weight, wgu, wd)):
            acc += np.asarray(g, np.float64)
        deferred = grad(x, index, weight, gmm.defer_wgrad(wgu, n, bm), gmm.defer_wgrad(wd, n, bm))
        for t, g in zip(taps, deferred):
            t.append(g)
    for total, want, t in zip(totals, plain, taps):
        got = gmm.grouped_wgrad_sum(total, [g.dy for g in t], [g.x for g in t], [g.tiles for g in t], impl="pallas")
        assert rel(got, want) <= 1e-2, f"seed {seed}"
        exact = sum(np.einsum("te,tmo,tmi->eoi", np.eye(E + 1)[np.asarray(g.tiles, np.int64)][:, :E],
                              np.asarray(g.dy, np.float64).reshape(-1, bm, g.dy.shape[1]),
                              np.asarray(g.x, np.float64).reshape(-1, bm, g.x.shape[1])) for g in t)
        assert rel(got, exact) <= 1e-5, f"seed {seed}"

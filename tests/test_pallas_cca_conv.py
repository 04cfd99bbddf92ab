"""CCA's depthwise convolution kernels (pallas_kernels/cca_conv.py) against the jnp reference
(zaya_jax/ops/cca_conv.py), forward and backward on fresh random inputs: interpret mode on the CPU, compiled with
`-m gpu`; inside shard_map their types lower for CUDA (weights replicated, rows sharded)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from test_pallas_rmsnorm import TOL, rel_err

from pallas_kernels import _platform, _vma
from zaya_jax.model.cca import same_segment_masks
from zaya_jax.ops.cca_conv import depthwise_taps, depthwise_taps_reference, halo


def problem(seed, B, T, C, t0, t1, segments, dtype):
    k = jax.random.split(jax.random.key(seed), 5)
    P = halo(t0, t1)
    xp = jax.random.normal(k[0], (B, T + P, C)).astype(dtype)
    w1 = 0.5 * jax.random.normal(k[1], (C, t0))
    b1 = 0.1 * jax.random.normal(k[2], (C,))
    same = None
    if segments:  # documents packed in each row: some columns of the halo belong to the previous one
        same = same_segment_masks(jnp.cumsum(jax.random.bernoulli(k[3], 0.15, (B, T)), axis=1), P)
    cotangents = [jax.random.normal(jax.random.fold_in(k[4], j), (B, T, C)).astype(dtype) for j in range(t1)]
    return xp, w1, b1, same, cotangents


def taps_and_grads(impl, xp, w1, b1, same, cotangents):
    t1 = len(cotangents)

    def loss(xp, w1, b1):
        ys = depthwise_taps(xp, w1, b1, t1, same, impl=impl)
        return sum((y.astype(jnp.float32) * c.astype(jnp.float32)).sum() for y, c in zip(ys, cotangents)), ys

    (_, ys), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(xp, w1, b1)
    return ys, grads


# time not a multiple of the row tile (16 on the CPU), channels below / above the 32-channel tile and not a power
# of two (24: 8-channel tiles), longer depthwise and grouped kernels, packed documents
CASES = [(2, 37, 48, 2, 2, False), (1, 50, 64, 3, 2, True), (2, 16, 24, 2, 3, True), (1, 5, 32, 2, 2, True)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,C,t0,t1,segments", CASES)
def test_kernels_match_the_reference(B, T, C, t0, t1, segments, dtype):
    inputs = problem(B * T + C, B, T, C, t0, t1, segments, dtype)
    (ys, grads), (ys_ref, grads_ref) = taps_and_grads("pallas", *inputs), taps_and_grads("xla", *inputs)
    for y, y_ref in zip(ys, ys_ref):
        assert y.dtype == y_ref.dtype == dtype and y.shape == y_ref.shape == (B, T, C)
        assert rel_err(y.astype(jnp.float32), y_ref.astype(jnp.float32)) <= TOL[dtype]
    for name, g, g_ref in zip(("xp", "w1", "b1"), grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        assert rel_err(g.astype(jnp.float32), g_ref.astype(jnp.float32)) <= TOL[dtype], name


def test_shapes_that_do_not_fit_are_rejected_and_unknown_impls_named():
    xp, w1, b1, _, _ = problem(0, 1, 8, 16, 2, 2, False, jnp.float32)
    with pytest.raises(ValueError, match="depthwise_taps: need xp"):
        depthwise_taps(xp, w1[:8], b1, 2, impl="pallas")
    with pytest.raises(ValueError, match="CCA convolution impl 'cuda' unknown"):
        depthwise_taps(xp, w1, b1, 2, impl="cuda")


def test_kernels_lower_inside_shard_map_for_cuda(monkeypatch):
    """Rows sharded over 8 devices, weights replicated: the weight gradients come back summed over the rows."""
    monkeypatch.setattr(_platform, "interpret", lambda: False)
    monkeypatch.setattr(_platform, "vendor", lambda: "cuda")
    xp, w1, b1, _, cts = problem(1, 8, 64, 128, 2, 2, False, jnp.bfloat16)

    def taps_and_grads(xp, w1, b1, c0, c1):
        def loss(xp, w1, b1):
            ys = depthwise_taps(xp, w1, b1, 2, impl="pallas")
            return (ys[0].astype(jnp.float32) * c0).sum() + (ys[1].astype(jnp.float32) * c1).sum(), ys[0]
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(xp, w1, b1)

    rows = P("data")
    text = _vma.lower_in_shard_map_for_cuda(taps_and_grads, (xp, w1, b1, *cts),
                                            in_specs=(rows, P(), P(), rows, rows), out_specs=((rows, P(), P()), rows))
    assert 'name = "cca_depthwise_fwd"' in text and 'name = "cca_depthwise_bwd"' in text
    assert "all_reduce" in text or "all-reduce" in text  # the replicated weights' gradients


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [False, True], ids=["plain", "documents"])
def test_kernels_on_the_gpu_at_the_zaya1_width(segments):
    """ZAYA1's CCA channels (8 + 2 heads of 128) over 4096 positions plus the halo."""
    inputs = problem(3, 2, 4096, 1280, 2, 2, segments, jnp.bfloat16)
    (ys, grads), (ys_ref, grads_ref) = taps_and_grads("pallas", *inputs), taps_and_grads("xla", *inputs)
    for a, b in zip([*ys, *grads], [*ys_ref, *grads_ref]):
        assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) <= TOL[jnp.bfloat16]

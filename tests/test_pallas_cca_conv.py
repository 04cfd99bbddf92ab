"""CCA's q/k mixing kernels (pallas_kernels/cca_conv.py: both convolutions and the mean residual paths) against the
jnp reference (zaya_jax/ops/cca_conv.py), forward and backward on fresh random inputs: interpret mode on the CPU,
compiled with `-m gpu`; inside shard_map their types lower for CUDA (weights replicated, rows sharded). The cached-halo
forward (a decode cache's chunk over its ring) against the reference's rolled concatenation, the ring bit for bit."""

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P
from test_pallas_rmsnorm import TOL, rel_err

from pallas_kernels import platform, vma
from zaya_jax.model.cca import same_segment_masks
from zaya_jax.ops.cca_conv import halo, qk_mix, qk_mix_cached


def problem(seed, B, T, heads, kv, d, t0, t1, segments, dtype):
    k = jax.random.split(jax.random.key(seed), 7)
    G, P = heads + kv, halo(t0, t1)
    C = G * d
    xp = jax.random.normal(k[0], (B, T + P, C)).astype(dtype)
    w1 = 0.5 * jax.random.normal(k[1], (C, t0))
    b1 = 0.1 * jax.random.normal(k[2], (C,))
    w2 = (jax.random.normal(k[3], (G, d, d, t1)) / d ** 0.5).astype(dtype)
    b2 = 0.1 * jax.random.normal(k[4], (C,))
    same = None
    if segments:  # documents packed in each row: some columns of the halo belong to the previous one
        same = same_segment_masks(jnp.cumsum(jax.random.bernoulli(k[5], 0.15, (B, T)), axis=1), P)
    cotangent = jax.random.normal(k[6], (B, T, C)).astype(dtype)
    return (xp, w1, b1, w2, b2), heads, same, cotangent


def mix_and_grads(impl, weights, heads, same, cotangent, zero_halo=False):
    def loss(*weights):
        out = qk_mix(*weights, heads, same, impl=impl, zero_halo=zero_halo)
        return (out.astype(jnp.float32) * cotangent.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*weights)
    return out, grads


# time not a multiple of the row tile (16 on the CPU) and shorter than it, GQA groups of 4, 2 and 1, head widths 16
# and 32, longer depthwise and grouped kernels, packed documents
CASES = [(2, 37, 4, 2, 16, 2, 2, False), (1, 50, 4, 1, 32, 3, 2, True), (2, 16, 2, 2, 16, 2, 3, True),
         (1, 5, 2, 1, 16, 2, 2, True)]
# every shape in fp32; bf16 (the dtype's casts and tolerance) on the case with the most of the shapes' features
# (time past a tile and not a multiple of it, a group of 4, width 32, t0 = 3, packed documents); the other bf16
# cases are slow (each compiles both paths again, 6-10 s on 2 cores): the shapes' paths run in fp32
BF16_DEFAULT = CASES[1]


@pytest.mark.parametrize("B,T,heads,kv,d,t0,t1,segments,dtype", [
    *(pytest.param(*case, jnp.float32, id="-".join(map(str, case)) + "-fp32") for case in CASES),
    *(pytest.param(*case, jnp.bfloat16, id="-".join(map(str, case)) + "-bf16",
                   marks=() if case == BF16_DEFAULT else pytest.mark.slow) for case in CASES)])
def test_kernels_match_the_reference(B, T, heads, kv, d, t0, t1, segments, dtype):
    inputs = problem(B * T + heads * d, B, T, heads, kv, d, t0, t1, segments, dtype)
    (out, grads), (out_ref, grads_ref) = mix_and_grads("pallas", *inputs), mix_and_grads("xla", *inputs)
    assert out.dtype == out_ref.dtype == dtype and out.shape == out_ref.shape == (B, T, (heads + kv) * d)
    assert rel_err(out.astype(jnp.float32), out_ref.astype(jnp.float32)) <= TOL[dtype]
    for name, g, g_ref in zip(("xp", "w1", "b1", "w2", "b2"), grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        assert rel_err(g.astype(jnp.float32), g_ref.astype(jnp.float32)) <= TOL[dtype], name


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_an_implied_zero_halo_on_a_wider_input_equals_the_concatenated_one(impl):
    """zero_halo over the first C channels of a wider array (a fused projection's output read in place) against the
    halo concatenated as zeros over exactly C channels: the same output; the same gradients on the T positions and
    none for the extra channels (the halo rows' gradient is the concatenated input's own)."""
    B, T, heads, kv, d, t0, t1 = 2, 37, 4, 2, 16, 3, 2
    (xp, w1, b1, w2, b2), _, same, ct = problem(5, B, T, heads, kv, d, t0, t1, True, jnp.float32)
    P_, C = halo(t0, t1), (heads + kv) * d
    x = jnp.concatenate([xp[:, P_:], jax.random.normal(jax.random.key(9), (B, T, 24))], axis=-1)
    padded = jnp.pad(x[..., :C], ((0, 0), (P_, 0), (0, 0)))

    def run(x, zero_halo):
        def loss(*weights):
            out = qk_mix(*weights, heads, same, impl=impl, zero_halo=zero_halo)
            return (out * ct).sum(), out
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(x, w1, b1, w2, b2)

    (_, out), grads = run(x, True)
    (_, out_ref), grads_ref = run(padded, False)
    assert jnp.array_equal(out, out_ref)
    assert rel_err(grads[0][..., :C], grads_ref[0][:, P_:]) <= TOL[jnp.float32]
    assert not grads[0][..., C:].any()
    for g, g_ref in zip(grads[1:], grads_ref[1:]):
        assert rel_err(g, g_ref) <= TOL[jnp.float32]


def test_the_kernels_read_bf16_weights_as_they_are():
    """A bf16 model's depthwise weights and biases enter the kernels uncast (they cast them as they read them): a
    cast outside would run again at every decode step, XLA hoisting no size-inflating op out of the loop."""
    (xp, w1, b1, w2, b2), heads, same, cotangent = problem(3, 1, 5, 2, 1, 16, 2, 2, True, jnp.bfloat16)
    weights = (xp, w1.astype(jnp.bfloat16), b1.astype(jnp.bfloat16), w2, b2.astype(jnp.bfloat16))
    (out, grads), (out_ref, grads_ref) = (mix_and_grads(impl, weights, heads, same, cotangent)
                                          for impl in ("pallas", "xla"))
    assert rel_err(out.astype(jnp.float32), out_ref.astype(jnp.float32)) <= TOL[jnp.bfloat16]
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == g_ref.dtype and rel_err(g.astype(jnp.float32), g_ref.astype(jnp.float32)) <= 2e-2

    def array_casts(jaxpr):  # converts of non-scalar arrays outside the kernels
        for e in jaxpr.eqns:
            if e.primitive.name == "convert_element_type" and e.invars[0].aval.shape:
                yield e.invars[0].aval
            for sub in (() if e.primitive.name == "pallas_call" else jaxprs_in_params(e.params)):
                yield from array_casts(sub)

    jaxpr = jax.make_jaxpr(lambda *w: qk_mix(*w, heads, same, impl="pallas"))(*weights).jaxpr
    assert list(array_casts(jaxpr)) == []


def test_shapes_that_do_not_fit_are_rejected_and_unknown_impls_named():
    (xp, w1, b1, w2, b2), heads, _, _ = problem(0, 1, 8, 2, 1, 16, 2, 2, False, jnp.float32)
    with pytest.raises(ValueError, match=r"need w1 \[C, t0\]"):
        qk_mix(xp, w1[:8], b1, w2, b2, heads, impl="pallas")
    with pytest.raises(ValueError, match="must be KV heads dividing them"):
        qk_mix(xp, w1, b1, w2, b2, 1, impl="pallas")
    with pytest.raises(ValueError, match="CCA convolution impl 'cuda' unknown"):
        qk_mix(xp, w1, b1, w2, b2, heads, impl="cuda")


@pytest.mark.parametrize("zero_halo", [False, True], ids=["halo", "zero-halo-wide"])
def test_kernels_lower_inside_shard_map_for_cuda(monkeypatch, zero_halo):
    """Rows sharded over 8 devices, weights replicated: the weight gradients come back summed over the rows. With
    zero_halo the input is a fused projection's wider output without halo rows."""
    monkeypatch.setattr(platform, "interpret", lambda: False)
    monkeypatch.setattr(platform, "vendor", lambda: "cuda")
    (xp, w1, b1, w2, b2), heads, _, ct = problem(1, 8, 64, 8, 2, 128, 2, 2, False, jnp.bfloat16)
    if zero_halo:
        xp = jnp.concatenate([xp[:, halo(2, 2):], xp[:, halo(2, 2):, :256]], axis=-1)

    def mix_and_grads(xp, w1, b1, w2, b2, ct):
        def loss(*weights):
            out = qk_mix(*weights, heads, impl="pallas", zero_halo=zero_halo)
            return (out.astype(jnp.float32) * ct).sum(), out
        return jax.grad(loss, argnums=tuple(range(5)), has_aux=True)(xp, w1, b1, w2, b2)

    rows = P("data")
    text = vma.lower_in_shard_map_for_cuda(mix_and_grads, (xp, w1, b1, w2, b2, ct),
                                            in_specs=(rows, P(), P(), P(), P(), rows),
                                            out_specs=((rows, P(), P(), P(), P()), rows))
    for name in ("cca_qk_mix_fwd", "cca_qk_mix_bwd_grouped", "cca_qk_mix_bwd_depthwise"):
        assert f'name = "{name}"' in text
    assert "all_reduce" in text or "all-reduce" in text  # the replicated weights' gradients


# a decode step (T = 1, shorter than both halos), a chunk shorter than the halo, prefill chunks past a row tile; GQA
# groups of 4 and 2; the fused projection's wider output read in place
CACHED_CASES = [(2, 1, 4, 1, 16, 2, 2, 24), (1, 2, 2, 1, 32, 3, 2, 0), (2, 5, 4, 2, 16, 3, 2, 8),
                (1, 37, 2, 2, 16, 2, 2, 0)]
SLOTS = (0, 1, 2, 3, 9)  # every ring offset (rings of 3 and 4 columns), and a chunk starting before the halo fills


def cached_problem(seed, B, T, heads, kv, d, t0, t1, extra, dtype):
    (xp, *weights), heads, _, _ = problem(seed, B, T, heads, kv, d, t0, t1, False, dtype)
    P_ = halo(t0, t1)
    x = jnp.concatenate([xp[:, P_:], jax.random.normal(jax.random.key(seed + 1), (B, T, extra)).astype(dtype)], -1)
    ring = jax.random.normal(jax.random.key(seed + 2), (B, P_ + 1, xp.shape[-1])).astype(dtype)
    return x, ring, weights, heads


def cached_mix(impl, heads):
    return jax.jit(lambda x, ring, slot, *w: qk_mix_cached(x, ring, slot, *w, heads, impl=impl))


@pytest.mark.parametrize("B,T,heads,kv,d,t0,t1,extra,dtype", [
    *(pytest.param(*case, jnp.float32, id="-".join(map(str, case)) + "-fp32") for case in CACHED_CASES),
    pytest.param(*CACHED_CASES[0], jnp.bfloat16, id="decode-bf16")])
def test_the_cached_ring_kernel_matches_the_reference(B, T, heads, kv, d, t0, t1, extra, dtype):
    """The kernel against the reference's rolled concatenation at every ring offset: the mix within the dtype's
    tolerance, the ring including the chunk bit for bit (copied columns)."""
    x, ring, weights, heads = cached_problem(B * T + d, B, T, heads, kv, d, t0, t1, extra, dtype)
    kernel, reference = cached_mix("pallas", heads), cached_mix("xla", heads)
    for slot in SLOTS:
        (out, new_ring), (out_ref, ring_ref) = (f(x, ring, jnp.int32(slot), *weights) for f in (kernel, reference))
        assert out.dtype == out_ref.dtype == dtype and out.shape == out_ref.shape == (B, T, (heads + kv) * d)
        assert rel_err(out.astype(jnp.float32), out_ref.astype(jnp.float32)) <= TOL[dtype], slot
        assert new_ring.dtype == ring.dtype and new_ring.shape == ring.shape
        assert (new_ring == ring_ref).all(), slot


def test_a_cached_ring_of_the_wrong_shape_is_rejected():
    x, ring, weights, heads = cached_problem(0, 1, 1, 2, 1, 16, 2, 2, 0, jnp.float32)
    for impl in ("pallas", "xla"):
        with pytest.raises(ValueError, match=r"the cached ring must be \[B, P \+ 1, C\]"):
            qk_mix_cached(x, ring[:, :2], jnp.int32(0), *weights, heads, impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("segments,zero_halo", [(False, False), (True, False), (True, True)],
                         ids=["plain", "documents", "documents-zero-halo"])
def test_kernels_on_the_gpu_at_the_zaya1_width(segments, zero_halo):
    """ZAYA1's CCA heads (8 query + 2 key heads of 128) over 4096 positions plus the halo (or an implied zero one)."""
    (xp, *weights), *rest = problem(3, 2, 4096, 8, 2, 128, 2, 2, segments, jnp.bfloat16)
    inputs = ((xp[:, halo(2, 2):] if zero_halo else xp, *weights), *rest)
    (out, grads), (out_ref, grads_ref) = (mix_and_grads("pallas", *inputs, zero_halo=zero_halo),
                                          mix_and_grads("xla", *inputs, zero_halo=zero_halo))
    for a, b in zip([out, *grads], [out_ref, *grads_ref]):
        assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) <= TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (64, 1), (2, 512)], ids=["decode-b1", "decode-b64", "prefill"])
def test_the_cached_ring_kernel_on_the_gpu_at_the_zaya1_width(B, T):
    x, ring, weights, heads = cached_problem(4, B, T, 8, 2, 128, 2, 2, 256, jnp.bfloat16)
    for slot in (0, 1, 2, 515):
        (out, new_ring), (out_ref, ring_ref) = (cached_mix(impl, heads)(x, ring, jnp.int32(slot), *weights)
                                                for impl in ("pallas", "xla"))
        assert rel_err(out.astype(jnp.float32), out_ref.astype(jnp.float32)) <= TOL[jnp.bfloat16]
        assert (new_ring == ring_ref).all()

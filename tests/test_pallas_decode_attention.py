"""One decode step's attention kernel (pallas_kernels/decode_attention.py; interpret mode on the CPU, compiled on a
GPU) against the jnp reference at one query: cache slots past the query's, left padding, sliding windows (static and
traced), grouped query heads, fp32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention, supported
from zaya_jax.ops.attention import attention_reference


def case(seed, B, S, H, KV, d, index, dtype):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q, k, v = normal(B, 1, H, d), normal(B, S, KV, d), normal(B, S, KV, d)
    pads = rng.integers(0, index + 1, B)  # left padding of each row's prompt
    kv_valid = jnp.asarray(np.arange(S)[None, :] >= pads[:, None]) & (jnp.arange(S) <= index)[None]
    return q, k, v, kv_valid


def reference(q, k, v, kv_valid, index, window):
    return attention_reference(q, k, v, q_positions=jnp.full((1, 1), index, jnp.int32),
                               kv_positions=jnp.arange(k.shape[1], dtype=jnp.int32)[None], kv_valid=kv_valid,
                               sliding_window=window)[:, 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 37, "traced"])
def test_matches_the_reference(dtype, window):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    B, S, H, KV, d = 3, 200, 8, 2, 32
    index = int(np.random.default_rng(seed).integers(1, S))
    q, k, v, kv_valid = case(seed, B, S, H, KV, d, index, dtype)
    w = jnp.int32(29) if window == "traced" else window
    got = jax.jit(decode_attention)(q[:, 0], k, v, kv_valid, jnp.int32(index), w)
    want = reference(q, k, v, kv_valid, index, w)
    err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2), f"seed {seed}, index {index}: {err:.2e}"


def test_first_and_last_slot_and_shapes_it_refuses():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    for index in (0, 127):
        q, k, v, kv_valid = case(seed, 2, 128, 4, 4, 16, index, jnp.float32)
        got = decode_attention(q[:, 0], k, v, kv_valid, jnp.int32(index))
        assert float(jnp.abs(got - reference(q, k, v, kv_valid, index, None)).max()) <= 1e-5, f"seed {seed}"
    assert not supported(40, 2, 128, 64) and not supported(8, 2, 96, 64) and supported(8, 2, 128, 64)
    with pytest.raises(ValueError, match="query heads"):
        decode_attention(jnp.zeros((1, 40, 128)), jnp.zeros((1, 8, 2, 128)), jnp.zeros((1, 8, 2, 128)),
                         jnp.ones((1, 8), bool), jnp.int32(0))


@pytest.mark.gpu
def test_compiled_on_gpu_at_zaya1_widths():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    for B, index, window in ((1, 600, None), (64, 700, 512)):
        q, k, v, kv_valid = case(seed, B, 768, 8, 2, 128, index, jnp.bfloat16)
        got = decode_attention(q[:, 0], k, v, kv_valid, jnp.int32(index), window).astype(jnp.float32)
        want = reference(q, k, v, kv_valid, index, window).astype(jnp.float32)
        assert float(jnp.abs(got - want).max()) <= 2e-2, f"seed {seed}"

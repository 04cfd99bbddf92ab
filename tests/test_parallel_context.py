"""Context parallelism on 8 emulated CPU devices: the zigzag layout, and logits and gradients of the
context-parallel model (CP = 2, 4, 8; all-gather and ring attention) equal to the single-device model in fp32.

The sequence is 32 tokens, so the zigzag chunks are 8, 4 and 2 tokens: every chunk boundary cuts through the
CCA convolution window (2 previous tokens), and at CP = 8 a chunk is exactly the halo. Every parameter is
perturbed away from its init (conv biases, key temperature, attention biases, ...), and packed documents with
resets put document starts on, just after and away from chunk boundaries.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax.config import tiny
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.base import BalancingBias
from zaya_jax.parallel.context import (
    ContextParallel,
    ContextParallelError,
    forward_logits,
)
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.parallel.zigzag import Zigzag, ZigzagError, from_layout, to_layout

S, B = 32, 8


def test_zigzag_layout_puts_chunks_r_and_mirror_on_rank_r():
    zz = Zigzag(cp=4, seq_len=16)  # 8 chunks of 2
    shares = zz.order().reshape(4, 4)  # rank r's contiguous share of the layout
    for r in range(4):
        assert shares[r].tolist() == [2 * r, 2 * r + 1, 2 * (7 - r), 2 * (7 - r) + 1]
    x = np.arange(3 * 16).reshape(3, 16)
    np.testing.assert_array_equal(from_layout(to_layout(x, zz), zz), x)
    with pytest.raises(ZigzagError):
        Zigzag(cp=4, seq_len=20)


def _model():
    cfg = tiny(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, moe_intermediate_size=32, num_experts=4, router_hidden_size=8, dtype="float32",
               remat="none", attention_bias=True)
    graphdef, params, model_state = nnx.split(ZayaForCausalLM(cfg, seed=0), nnx.Param, BalancingBias)
    @jax.jit  # one program for every leaf's draw (eager: one per leaf shape)
    def perturb(params):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        return treedef.unflatten([p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])

    params = perturb(params)
    return cfg, graphdef, params, model_state


def _documents():
    """Rows 0-1 one document; the others with starts at chunk boundaries (8, 16, 24), one token after (5, 13)
    and inside chunks; RoPE positions restart at each document."""
    seg = np.zeros((B, S), np.int32)
    for row, starts in enumerate([[], [], [8, 16, 24], [5, 13, 14], [1, 2, 30], [4, 12, 20, 28], [17], [3, 9, 31]]):
        for s in starts:
            seg[row, s:] += 1
    pos = np.zeros_like(seg)
    for row in range(B):
        for t in range(1, S):
            pos[row, t] = 0 if seg[row, t] != seg[row, t - 1] else pos[row, t - 1] + 1
    return jnp.asarray(seg), jnp.asarray(pos)


@pytest.fixture(scope="module")
def reference():
    cfg, graphdef, params, model_state = _model()
    ids = jax.random.randint(jax.random.key(2), (B, S), 0, cfg.vocab_size)
    seg, pos = _documents()
    cotangent = jax.random.normal(jax.random.key(3), (B, S, cfg.vocab_size))

    @jax.jit
    def single(params):
        logits, vjp = jax.vjp(lambda p: nnx.merge(graphdef, p, model_state)(ids, positions=pos, segment_ids=seg),
                              params)
        return logits, vjp(cotangent)[0]

    logits, grads = single(params)
    return dict(graphdef=graphdef, params=params, model_state=model_state, ids=ids, seg=seg, pos=pos,
                cotangent=cotangent, logits=logits, grads=grads, cfg=cfg)


# Default: the all-gather at 2 chunks and the ring at 8 (every hop and the wrap-around); the rest is slow. cp=4 adds
# no path that 2 and 8 leave out (ring steps, zigzag pairs); the ring at 2 is ring-8's exchange with one hop;
# all-gather at cp=8 gathers as cp=2 does, and cp=8's chunks of exactly the halo go through the same CCA halo exchange
# under ring-8 (the attention variants differ in attention only)
@pytest.mark.parametrize("cp, variant", [(2, "allgather"), pytest.param(4, "allgather", marks=pytest.mark.slow),
                                         pytest.param(8, "allgather", marks=pytest.mark.slow),
                                         pytest.param(2, "ring", marks=pytest.mark.slow),
                                         pytest.param(4, "ring", marks=pytest.mark.slow), (8, "ring")],
                         ids=["allgather-2", "allgather-4", "allgather-8", "ring-2", "ring-4", "ring-8"])
def test_context_parallel_logits_and_gradients_equal_single_device(reference, cp, variant):
    r = reference
    mesh = make_mesh(data=8 // cp, context=cp)
    ctx = ContextParallel(Zigzag(cp, S), attention=variant)
    ctx.check(r["cfg"])

    @jax.jit
    def parallel(params):
        logits, vjp = jax.vjp(lambda p: forward_logits(r["graphdef"], p, r["model_state"], r["ids"], mesh, ctx,
                                                       positions=r["pos"], segment_ids=r["seg"]), params)
        return logits, vjp(r["cotangent"])[0]

    logits, grads = jax.device_get(parallel(r["params"]))
    np.testing.assert_allclose(logits, np.asarray(r["logits"]), atol=1e-5, rtol=0)
    # on the host: eager jnp ops here would compile one program per leaf shape and op
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(r["grads"])):
        want = np.asarray(want)
        err = np.max(np.abs(g - want)) / (np.max(np.abs(want)) + 1e-6)
        assert err < 1e-5, (jax.tree_util.keystr(path), err)


def test_rejects_chunks_shorter_than_the_cca_halo():
    cfg = _model()[0]
    with pytest.raises(ContextParallelError, match="halo"):
        ContextParallel(Zigzag(8, 16)).check(cfg)  # chunks of 1 token < 2
    with pytest.raises(ContextParallelError, match="attention"):
        ContextParallel(Zigzag(2, 32), attention="ulysses").check(cfg)

"""Softmax cross-entropy over a large vocabulary: each row's loss and its logit gradient in one kernel (Pallas,
Triton lowering).

    softmax_xent(logits [N, V], targets [N] int32, weights [N] fp32)
        -> loss [N] fp32 = weights * (logsumexp(logits) - logits[target]),
           d_logits [N, V] in the logits' dtype = weights * (softmax(logits) - onehot(target))

The chunked head loss (zaya_jax/model/loss.py) forms the gradient of each chunk of logits right after the head GEMM.
XLA spends 7.5 bf16 logit reads beyond the head's GEMMs on that (an fp32 copy of the logits, reductions over it,
the gradient pass; launch/bench_ce.py). Here one program walks one row twice: an online max / sum-exp pass, then a
pass that writes the gradient and picks up the target logit: two reads and one write of the logits.

Rows are [V] vectors read in power-of-two blocks with the tail masked, so any V works (ZAYA1: 262272). Statistics are
fp32. A row with weight 0 gets loss 0 and a zero gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _platform, _vma

F32 = jnp.float32
NEG = -1.0e30  # masked tail entries: exp(NEG - max) == 0 without inf arithmetic


def _xent_kernel(x_ref, t_ref, w_ref, loss_ref, d_ref, *, vocab: int, block: int):
    n_blocks = pl.cdiv(vocab, block)
    lanes = jnp.arange(block)
    target, weight = t_ref[...], w_ref[...]  # [1]

    def cols(j):
        idx = j * block + lanes
        return idx, idx < vocab

    def stats(j, carry):
        top, total = carry
        idx, ok = cols(j)
        x = plgpu.load(x_ref.at[idx], mask=ok, other=NEG).astype(F32)
        new_top = jnp.maximum(top, jnp.max(x, axis=0, keepdims=True))
        return new_top, total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(x - new_top), axis=0, keepdims=True)

    top, total = jax.lax.fori_loop(0, n_blocks, stats, (jnp.full((1,), NEG, F32), jnp.zeros((1,), F32)))
    lse = top + jnp.log(total)

    def grad(j, picked):
        idx, ok = cols(j)
        x = plgpu.load(x_ref.at[idx], mask=ok, other=NEG).astype(F32)
        hit = idx == target
        plgpu.store(d_ref.at[idx], (weight * (jnp.exp(x - lse) - hit.astype(F32))).astype(d_ref.dtype), mask=ok)
        return picked + jnp.sum(jnp.where(hit, x, 0.0), axis=0, keepdims=True)

    picked = jax.lax.fori_loop(0, n_blocks, grad, jnp.zeros((1,), F32))
    loss_ref[...] = jnp.where(weight != 0, weight * (lse - picked), 0.0)


def _launch(vocab: int):
    """(column block, warps) per platform: 4096 columns x 4 warps reads 8 KB of bf16 per step per program, and many
    small programs per SM hide the memory latency. ROCm's 64-lane wavefronts take half the warps."""
    if _platform.vendor() == "cpu":
        return min(_platform.next_pow2(vocab), 512), 4
    return min(_platform.next_pow2(vocab), 4096), 2 if _platform.vendor() == "rocm" else 4


def softmax_xent(logits, targets, weights):
    """See the module doc. logits [N, V] (bf16 / fp16 / fp32), targets [N] int (in [0, V) where weights != 0),
    weights [N] -> (loss [N] fp32, d_logits [N, V] logits.dtype)."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1] or weights.shape != logits.shape[:1]:
        raise ValueError(f"softmax_xent needs logits [N, V], targets [N], weights [N]; got {logits.shape}, "
                         f"{targets.shape}, {weights.shape}")
    n, vocab = logits.shape
    block, warps = _launch(vocab)
    logits, targets, weights = _vma.vary_to_union(logits, targets.astype(jnp.int32), weights.astype(F32))
    row = pl.BlockSpec((None, vocab), lambda i: (i, 0))
    one = pl.BlockSpec((1,), lambda i: (i,))
    loss, d_logits = pl.pallas_call(
        functools.partial(_xent_kernel, vocab=vocab, block=block),
        grid=(n,),
        in_specs=[row, one, one],
        out_specs=[one, row],
        out_shape=[_vma.out_struct((n,), F32, logits), _vma.out_struct((n, vocab), logits.dtype, logits)],
        compiler_params=_platform.compiler_params(warps, 1),
        interpret=_platform.interpret(), name="softmax_xent",
    )(logits, targets, weights)
    return loss, d_logits


__all__ = ["softmax_xent"]

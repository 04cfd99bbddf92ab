"""Softmax cross-entropy over a large vocabulary: each row's loss and its logit gradient in one kernel (Pallas,
Triton lowering).

    softmax_xent(logits [N, V], targets [N] int32, weights [N] fp32)
        -> loss [N] fp32 = weights * (logsumexp(logits) - logits[target]),
           d_logits [N, V] in the logits' dtype = weights * (softmax(logits) - onehot(target))

The chunked head loss (zaya_jax/model/loss.py) forms the gradient of each chunk of logits right after the head GEMM.
Here one program walks one row twice: an online max / sum-exp pass, then a pass (from the row's end back) that writes
the gradient and picks up the target logit: two reads and one write of the logits. On the H200 it runs near copy
bandwidth and faster than XLA's fusions of the same reference (docs/experiments.md).

Rows are [V] vectors read in power-of-two blocks with the tail masked, so any V works (ZAYA1: 262272). Statistics are
fp32. A row with weight 0 gets loss 0 and a zero gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import platform, vma

F32 = jnp.float32
NEG = -1.0e30  # masked tail entries: exp(NEG - max) == 0 without inf arithmetic


@dataclasses.dataclass(frozen=True)
class XentLaunch:
    """Columns per loop step, warps per program, and blocks loaded `prefetch` steps ahead (carried in registers:
    Triton does not pipeline loads of a loop without a dot). On the H200 4096 columns x 8 warps x 1 ahead came
    closest to copy bandwidth; fewer warps, narrower or wider blocks were slower (docs/experiments.md).
    reverse: the second pass walks the row from its end, so it starts on the blocks most likely still in the L2
    cache (faster on the H200). Programs that each walk a range of rows (fewer rows in flight, more of each in L2)
    measured slower there: too few loads in flight to keep the memory busy."""
    block: int = 4096
    num_warps: int = 8
    prefetch: int = 1
    reverse: bool = True


def _walk(n_blocks: int, load, body, carry, prefetch: int):
    """body(j, tile, carry) over column blocks j, tile = load(j) issued `prefetch` steps earlier."""
    if not prefetch:
        return jax.lax.fori_loop(0, n_blocks, lambda j, c: body(j, load(j), c), carry)

    def step(j, state):
        ahead, carry = state  # ahead[k] holds block j + k; past the end the loads are fully masked
        return (*ahead[1:], load(j + prefetch)), body(j, ahead[0], carry)

    return jax.lax.fori_loop(0, n_blocks, step, (tuple(load(k) for k in range(prefetch)), carry))[1]


def _xent_kernel(x_ref, t_ref, w_ref, loss_ref, d_ref, *, vocab: int, block: int, prefetch: int, reverse: bool):
    n_blocks = pl.cdiv(vocab, block)
    lanes = jnp.arange(block)
    target, weight = t_ref[...], w_ref[...]  # [1]

    def load(j):
        idx = j * block + lanes
        return plgpu.load(x_ref.at[idx], mask=(idx >= 0) & (idx < vocab), other=NEG)

    def stats(j, x, carry):
        top, total = carry
        x = x.astype(F32)
        new_top = jnp.maximum(top, jnp.max(x, axis=0, keepdims=True))
        return new_top, total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(x - new_top), axis=0, keepdims=True)

    init = (jnp.full((1,), NEG, F32), jnp.zeros((1,), F32))
    top, total = _walk(n_blocks, load, stats, init, prefetch)
    lse = top + jnp.log(total)
    order = (lambda j: n_blocks - 1 - j) if reverse else (lambda j: j)

    def grad(j, x, picked):
        x = x.astype(F32)
        idx = order(j) * block + lanes
        hit = idx == target
        plgpu.store(d_ref.at[idx], (weight * (jnp.exp(x - lse) - hit.astype(F32))).astype(d_ref.dtype),
                    mask=(idx >= 0) & (idx < vocab))
        return picked + jnp.sum(jnp.where(hit, x, 0.0), axis=0, keepdims=True)

    # past either end the loads are fully masked (prefetch beyond the last block, j < 0 in reverse)
    picked = _walk(n_blocks, lambda j: load(order(j)), grad, jnp.zeros((1,), F32), prefetch)
    loss_ref[...] = jnp.where(weight != 0, weight * (lse - picked), 0.0)


def default_launch(vocab: int) -> XentLaunch:
    """Per platform. The interpreter takes small blocks (several per row in the tests); ROCm's 64-lane wavefronts
    take half the warps for as many lanes (untuned there)."""
    vendor = platform.vendor()
    if vendor == "cpu":
        return XentLaunch(block=min(platform.next_pow2(vocab), 512), num_warps=4, prefetch=1)
    launch = XentLaunch(block=min(platform.next_pow2(vocab), 4096))
    return dataclasses.replace(launch, num_warps=max(1, launch.num_warps // 2)) if vendor == "rocm" else launch


def softmax_xent(logits, targets, weights, launch: XentLaunch | None = None):
    """See the module doc. logits [N, V] (bf16 / fp16 / fp32), targets [N] int (in [0, V) where weights != 0),
    weights [N] -> (loss [N] fp32, d_logits [N, V] logits.dtype). launch: overrides the platform's (benchmarks)."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1] or weights.shape != logits.shape[:1]:
        raise ValueError(f"softmax_xent needs logits [N, V], targets [N], weights [N]; got {logits.shape}, "
                         f"{targets.shape}, {weights.shape}")
    n, vocab = logits.shape
    launch = launch or default_launch(vocab)
    if launch.block & (launch.block - 1) or launch.prefetch < 0:
        raise ValueError(f"XentLaunch needs a power-of-two block and prefetch >= 0, got {launch}")
    logits, targets, weights = vma.vary_to_union(logits, targets.astype(jnp.int32), weights.astype(F32))
    row = pl.BlockSpec((None, vocab), lambda i: (i, 0))
    one = pl.BlockSpec((1,), lambda i: (i,))
    loss, d_logits = pl.pallas_call(
        functools.partial(_xent_kernel, vocab=vocab, block=launch.block, prefetch=launch.prefetch,
                          reverse=launch.reverse),
        grid=(n,),
        in_specs=[row, one, one],
        out_specs=[one, row],
        out_shape=[vma.out_struct((n,), F32, logits), vma.out_struct((n, vocab), logits.dtype, logits)],
        compiler_params=platform.compiler_params(launch.num_warps, 1),
        interpret=platform.interpret(), name="softmax_xent",
    )(logits, targets, weights)
    return loss, d_logits


__all__ = ["XentLaunch", "default_launch", "softmax_xent"]

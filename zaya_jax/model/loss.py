"""Next-token cross-entropy, the only ZAYA1 training loss (no auxiliary router or z-loss in any reference).

Same definition as the Hugging Face causal-LM loss: logits in fp32, position t predicts labels[t + 1], labels equal
to `ignore_index` (padding, prompt tokens) count for nothing, mean over the counted tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zaya_jax.ops.cross_entropy import softmax_xent, softmax_xent_loss

IGNORE_INDEX = -100


def token_cross_entropy_terms(logits, targets, mask):
    """Aligned targets (logits[t] predicts targets[t]): per-token fp32 CE [B, T] (0 where mask is 0) and the mask."""
    logits = logits.astype(jnp.float32)
    counted = mask.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.where(counted > 0, log_z - target_logit, 0.0), counted


def next_token_loss_terms(logits, labels, ignore_index: int = IGNORE_INDEX):
    """Per-token losses [B, T-1] (0 where ignored) and the mask of counted tokens [B, T-1] (float32)."""
    targets = labels[:, 1:]
    counted = targets != ignore_index
    safe_targets = jnp.where(counted, targets, 0)  # any valid index; the term is masked out
    return token_cross_entropy_terms(logits[:, :-1], safe_targets, counted)


def next_token_cross_entropy(logits, labels, ignore_index: int = IGNORE_INDEX):
    """Mean next-token CE over counted tokens; 0 (not NaN, unlike torch) when no token counts."""
    terms, counted = next_token_loss_terms(logits, labels, ignore_index)
    return terms.sum() / jnp.maximum(counted.sum(), 1.0)


# ---- chunked cross-entropy through the vocabulary head ------------------------------------------------------------
#
# The same per-token terms as `token_cross_entropy_terms(head_logits(hidden, head, bias), ...)`, summed, without
# holding the [N, V] logits (V = 262272: 1 GiB per 1024 tokens) or their gradient: tokens go through the head in chunks
# under lax.scan. When differentiated, each chunk's gradient is formed right there (Liger-style fused linear
# cross-entropy): d logits = mask * (softmax - onehot), in the compute dtype, feeds the two head-gradient GEMMs
# (bf16 operands, fp32 accumulation when the compute dtype is bf16; all fp32 in fp32), d head accumulates in fp32
# across chunks. The backward pass then only scales the stored gradients by the incoming cotangent, so the head
# costs the same 6*N*D*V FLOPs as the unchunked path and no logits are recomputed.


def _pad_chunks(x, n_chunks: int, chunk: int):
    pad = n_chunks * chunk - x.shape[0]
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((n_chunks, chunk) + x.shape[1:])


def _head_chunks(hidden, targets, mask, chunk_tokens: int):
    n = hidden.shape[0]
    chunk = max(1, min(int(chunk_tokens), n))
    n_chunks = -(-n // chunk)
    return (_pad_chunks(hidden, n_chunks, chunk), _pad_chunks(targets, n_chunks, chunk),
            _pad_chunks(mask.astype(jnp.float32), n_chunks, chunk))


def head_logits(h, w, bias=None):
    """Logits of the vocabulary head as Hugging Face's lm_head gives them: one GEMM in the compute dtype with fp32
    accumulation (bias added before the single rounding), returned in the compute dtype. The loss upcasts them to
    fp32 inside its reductions; in bf16 the largest tensor of the step then moves half the bytes."""
    w = w.astype(h.dtype)
    if bias is None:
        return jnp.einsum("...d,vd->...v", h, w)
    return (jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
            + bias.astype(jnp.float32)).astype(h.dtype)


def _zero_like_tokens(ms):
    """A 0.0 that carries the tokens' sharding type: inside shard_map the scan carries accumulate per-device
    (varying) values, so their initial values must be varying too."""
    return ms[:0].sum()


def _head_ce_sum(hidden, weight, weight_compute, bias, targets, mask, chunk_tokens):
    w = weight.astype(hidden.dtype) if weight_compute is None else weight_compute
    hs, ts, ms = _head_chunks(hidden, targets, mask, chunk_tokens)

    def body(total, xs):
        h, t, m = xs
        # the same loss terms as the differentiated path's (_head_ce_fwd), without the gradient pass
        return total + softmax_xent_loss(head_logits(h, w, bias), t, m).sum(), None

    return jax.lax.scan(body, _zero_like_tokens(ms), (hs, ts, ms))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _head_ce(hidden, weight, weight_compute, bias, targets, mask, chunk_tokens, impl):
    return _head_ce_sum(hidden, weight, weight_compute, bias, targets, mask, chunk_tokens)


def _head_ce_fwd(hidden, weight, weight_compute, bias, targets, mask, chunk_tokens, impl):
    dt = hidden.dtype
    w = weight.astype(dt) if weight_compute is None else weight_compute  # weight itself is then never read
    n = hidden.shape[0]
    hs, ts, ms = _head_chunks(hidden, targets, mask, chunk_tokens)

    def chunk(h, t, m, d_w_dtype):
        terms, d_logits = softmax_xent(head_logits(h, w, bias), t, m, impl)
        d_h = jnp.einsum("nv,vd->nd", d_logits, w, preferred_element_type=jnp.float32)
        d_w = jnp.einsum("nv,nd->vd", d_logits, h, preferred_element_type=d_w_dtype)
        d_b = None if bias is None else d_logits.astype(jnp.float32).sum(axis=0)
        return terms.sum(), d_w, d_b, d_h

    if hs.shape[0] == 1:
        # One chunk: d head straight out of its GEMM in the weight's dtype (fp32 accumulation, one rounding), the
        # gradient itself when the cotangent is 1 (see chunked_head_cross_entropy's `mean`).
        total, d_w, d_b, d_h = chunk(hs[0], ts[0], ms[0], weight.dtype)
    else:
        # The first chunk starts the fp32 sums: no zero-filled [V, D] buffer written and read back.
        total, d_w, d_b, d_h0 = chunk(hs[0], ts[0], ms[0], jnp.float32)

        def body(carry, xs):
            total, d_w, d_b = carry
            terms, d_w_c, d_b_c, d_h = chunk(*xs, jnp.float32)
            return (total + terms, d_w + d_w_c, None if d_b is None else d_b + d_b_c), d_h

        (total, d_w, d_b), d_hs = jax.lax.scan(body, (total, d_w, d_b), (hs[1:], ts[1:], ms[1:]))
        d_h = jnp.concatenate([d_h0[None], d_hs])
    d_h = d_h.reshape(-1, hidden.shape[-1])[:n]
    like = lambda x: None if x is None else jnp.zeros((0,), x.dtype)  # dtype carriers (residuals must be arrays)
    return total, (d_h, d_w, d_b, like(hidden), like(weight), like(bias), targets, mask)


def _head_ce_bwd(chunk_tokens, impl, res, g):
    d_h, d_w, d_b, h_like, w_like, b_like, targets, mask = res
    d_b = None if d_b is None else (g * d_b).astype(b_like.dtype)
    return ((g * d_h).astype(h_like.dtype), (g * d_w).astype(w_like.dtype), None, d_b,
            jnp.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(mask))


_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)


def chunked_head_cross_entropy(hidden, weight, targets, mask, *, bias=None, chunk_tokens: int = 4096,
                               impl: str = "xla", mean: bool = False, weight_compute=None):
    """Sum over tokens of the masked next-token CE of `hidden @ weight^T (+ bias)`, and the counted-token total.

    hidden [..., D] (compute dtype; the head GEMMs run in it with fp32 accumulation), weight [V, D] (any float dtype,
    cast to hidden's; its gradient comes back in its own dtype, accumulated in fp32), targets [...] aligned
    (hidden[t] predicts targets[t]), mask [...] (0 = not counted), bias [V] or None. Equals
    `token_cross_entropy_terms(head_logits(hidden, weight, bias), targets, mask)` summed (the logits of
    `ZayaForCausalLM.logits`); peak extra memory is about one chunk of logits and their gradient (chunk_tokens x V)
    instead of all of them. impl: how each chunk's loss and logit gradient are formed (zaya_jax/ops/cross_entropy.py:
    'xla' or the 'pallas' kernel).

    mean: the first value is the mean over counted tokens (0 when none count), with each token's weight divided by
    the count up front (as Hugging Face's loss scales its fp32 logit gradient). Differentiated alone, its cotangent
    is then 1 and the backward's scaling of the [V, D] head gradient is a no-op XLA removes: with one chunk that
    gradient leaves its GEMM final, in the weight's dtype. (With one chunk and a weight narrower than fp32, a
    cotangent other than 1 rounds that gradient a second time.)

    weight_compute: weight already cast to hidden's dtype (the accumulating step casts the tied table once per step,
    model/embedding_tap.py); the GEMMs read it instead of casting weight, whose gradient is formed as without it."""
    d = hidden.shape[-1]
    if weight_compute is not None and (weight_compute.shape != weight.shape or weight_compute.dtype != hidden.dtype):
        raise ValueError(f"weight_compute must be weight {weight.shape} in the hidden states' dtype {hidden.dtype}, "
                         f"got {weight_compute.dtype} {weight_compute.shape}")
    flat_mask = mask.reshape(-1).astype(jnp.float32)
    counted = flat_mask.sum()
    weights = flat_mask / jnp.maximum(counted, 1.0) if mean else flat_mask
    total = _head_ce(hidden.reshape(-1, d), weight, weight_compute, bias, targets.reshape(-1).astype(jnp.int32),
                     weights, int(chunk_tokens), impl)
    return total, counted

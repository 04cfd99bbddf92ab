"""The embedding lookup's gradient as rows, for the accumulating train step.

The tied table [V, D] gets two gradients per microbatch: the head's (one GEMM, [V, D] fp32) and the lookup's (a
scatter-add of the looked-up rows' gradients). Summed in the microbatch, they leave the GEMM as an operand of the
scatter, so the pass's sum over microbatches became one more fp32 pass over k + 1 tables of V x D, a visible share
of the accumulating step at the bench widths (docs/experiments.md). With the lookup's gradient taken out as rows (a
zero tap added to the looked-up rows), the table's gradient is the head GEMM alone and the rows are scattered into
the sum after the pass: the same terms, summed in another order. (XLA folds the first head GEMM of a pass into the
sum, cuBLAS beta = 1, but still sums the other three in a separate fusion, whichever order the adds are written in;
the tap with the head copy below gave a small gain at 16 microbatches, docs/experiments.md.)

The tap also carries the table cast once per step to the compute dtype for the head GEMMs (without it the cast ran
once per pass of the microbatch loop, a full read and write of the table each time); the head's gradient is still
formed for the fp32 table (model/loss.py: chunked_head_cross_entropy's weight_compute).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.model.compute_view import tree_get, tree_replace

EMBEDDING = ("model", "embed_tokens", "weight")


class EmbeddingRowsTap(NamedTuple):
    """The embedding table with a zero tap [B, T, D] (fp32) added to its looked-up rows: the tap's cotangent is
    the rows' gradient and the table's own gradient leaves the lookup out. head: the table in the compute dtype
    (no gradient flows into it) or None."""
    weight: jax.Array
    rows: jax.Array
    head: jax.Array | None = None


def table(w):
    """The table itself, tapped or not (the head reads it)."""
    return w.weight if isinstance(w, EmbeddingRowsTap) else w


def head_copy(w):
    """The table in the compute dtype for the head, when the tap carries one (else None)."""
    return w.head if isinstance(w, EmbeddingRowsTap) else None


def lookup(w, ids):
    """w[ids] in fp32 ([B, T, D]); through the tap when w is tapped."""
    if isinstance(w, EmbeddingRowsTap):
        return jnp.take(jax.lax.stop_gradient(w.weight), ids, axis=0).astype(jnp.float32) + w.rows
    return jnp.take(w, ids, axis=0).astype(jnp.float32)


def tap(view, ids_shape, head_dtype=None):
    """The parameter view with the embedding table tapped for a microbatch of ids_shape [B, T]; head_dtype (the
    compute dtype of a tied head): with the table cast to it for the head."""
    w = tree_get(view, EMBEDDING)
    head = None if head_dtype is None else jax.lax.stop_gradient(w.astype(head_dtype))
    return tree_replace(view, EMBEDDING, EmbeddingRowsTap(w, jnp.zeros((*ids_shape, w.shape[1]), jnp.float32), head))


def split(grads):
    """A tapped view's gradients -> (the plain structure, the table's gradient being the head's alone; the rows'
    gradient [B, T, D])."""
    g = tree_get(grads, EMBEDDING)
    return tree_replace(grads, EMBEDDING, g.weight), g.rows


def add_rows(total, rows, ids):
    """total (fp32, plain structure) with each microbatch's row gradients scattered into the table's sum, in order."""
    t = tree_get(total, EMBEDDING)
    for r, i in zip(rows, ids):
        t = t.at[i.reshape(-1)].add(r.reshape(-1, r.shape[-1]))
    return tree_replace(total, EMBEDDING, t)

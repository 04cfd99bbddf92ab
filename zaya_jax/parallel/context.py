"""Context parallelism for CCA: run the model on one rank's zigzag share of the sequence, inside shard_map.

Layout (zigzag.py): rank r of the `context` axis holds chunks r and 2·CP-1-r, c tokens each. Inside the model a
rank's share [b, 2c] is laid out as rows [2b, c] (row 2i = chunk r of sequence i, row 2i+1 = its chunk
2·CP-1-r), so every row is one contiguous piece of a sequence and all token-local work (projections, MoE,
norms, loss) runs unchanged. Only two things cross chunk boundaries (spec 4.12), and both plug into the model
through its hooks:

* CCA boundary (`cca_exchange`): a chunk needs the last `conv_halo` (= 2) raw [q | k] columns and the last
  delayed-value projection of the chunk before it. Chunk r's predecessor r-1 is rank r-1's first chunk; chunk
  2·CP-1-r's predecessor 2·CP-2-r is rank r+1's second chunk (or, on the last rank, its own first chunk). Two
  `lax.ppermute`s per layer move them; the first chunk of a sequence gets the sequence-start state (zeros, and
  v_proj_delayed(0)). Gradients flow back through ppermute's transpose (the reverse permutation).
* Attention (`attend`), causal in the global token order, two variants:
  - 'allgather': all-gather K/V over `context` and attend locally with a zigzag-causal mask. CCA's K/V are only
    2 heads x d per token (1/4 of the query width), so the gather is cheap; it is the simpler default.
  - 'ring': K/V blocks travel around the ring with `lax.ppermute`, the next block's transfer is issued before
    the current block is computed (so the two overlap), and partial results merge by their log-sum-exp. The
    zigzag halves the work of every non-local block: an earlier rank's block is seen fully by both of our chunks
    through its first chunk only; a later rank's block only by our second chunk.
Packed documents (segment ids) are honoured across chunk boundaries: the halo and the delayed value are
replaced by the sequence-start state where the neighbouring token belongs to another document.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from zaya_jax.model.cca import CCAState
from zaya_jax.ops import attention as attention_ops
from zaya_jax.parallel.zigzag import Zigzag, from_layout, to_layout

ATTENTION_VARIANTS = ("allgather", "ring")
_NEG = float(jnp.finfo(jnp.float32).min)


class ContextParallelError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    zigzag: Zigzag
    attention: str = "allgather"
    impl: str = "xla"  # attention implementation for each block (ops/attention.py)
    axis: str = "context"

    def check(self, cfg):
        """Raises for model configs this context parallelism cannot run exactly."""
        if self.attention not in ATTENTION_VARIANTS:
            raise ContextParallelError(f"context attention must be one of {ATTENTION_VARIANTS}, got "
                                       f"{self.attention!r}")
        if self.zigzag.chunk < max(cfg.conv_halo, 1):
            raise ContextParallelError(f"zigzag chunks of {self.zigzag.chunk} tokens are shorter than the CCA halo "
                                       f"({cfg.conv_halo}); use a longer sequence or less context parallelism")
        if "hybrid_sliding" in cfg.layer_types:
            raise ContextParallelError("sliding-window layers are not supported under context parallelism")

    # ---- layouts (inside shard_map) -------------------------------------------------------------------------
    def rows(self, x):
        """[b, 2c, ...] -> [2b, c, ...] (each row one contiguous chunk); [b] per-sequence values -> [2b]."""
        if x.ndim == 1:
            return jnp.repeat(x, 2)
        b = x.shape[0]
        return x.reshape(b * 2, self.zigzag.chunk, *x.shape[2:])

    def seq(self, x):
        """[2b, c, ...] -> [b, 2c, ...] (this rank's share, layout order)."""
        return x.reshape(x.shape[0] // 2, 2 * self.zigzag.chunk, *x.shape[2:])

    def order_of(self, rank, b: int):
        """[b, 2c] global token index (causal order) of the share rank `rank` holds."""
        c = self.zigzag.chunk
        first, second = self.zigzag.chunks_of(rank)
        idx = jnp.concatenate([first * c + jnp.arange(c), second * c + jnp.arange(c)]).astype(jnp.int32)
        return jnp.broadcast_to(idx, (b, 2 * c))

    # ---- model hooks (inside shard_map) ---------------------------------------------------------------------
    def local_forward(self, model, input_ids, positions=None, segment_ids=None):
        """One rank's share [b, 2c] (layout order) -> (fp32 logits [2b, c, V] in rows layout, ForwardAux).
        positions: RoPE positions (default: the global token index); segment_ids: packed documents."""
        b = input_ids.shape[0]
        order = self.order_of(lax.axis_index(self.axis), b)
        positions = order if positions is None else positions
        seg_rows = None if segment_ids is None else self.rows(segment_ids)
        return model.forward(self.rows(input_ids), positions=self.rows(positions), segment_ids=seg_rows,
                             attend=self._attend_fn(order, segment_ids),
                             cca_exchange=self._exchange_fn(2 * b, model.cfg.conv_halo, seg_rows))

    def _neighbour(self, x):
        """Rows-layout x [2b, ...] holding each chunk's tail -> the tail of each chunk's predecessor."""
        cp, ax = self.zigzag.cp, self.axis
        pair = x.reshape(x.shape[0] // 2, 2, *x.shape[1:])
        first, second = pair[:, 0], pair[:, 1]
        if cp > 1:
            from_left = lax.ppermute(first, ax, [(i, i + 1) for i in range(cp - 1)])  # chunk r-1
            from_right = lax.ppermute(second, ax, [(i + 1, i) for i in range(cp - 1)])  # chunk 2CP-2-r
        else:
            from_left = from_right = jnp.zeros_like(first)
        last_rank = lax.axis_index(ax) == cp - 1
        before_second = jnp.where(last_rank, first, from_right)  # the middle: chunk CP-1 precedes chunk CP
        return jnp.stack([from_left, before_second], axis=1).reshape(x.shape)

    def _exchange_fn(self, n_rows: int, halo: int, seg_rows):
        """cca_exchange(tail, start) for every layer. Which rows keep their predecessor's state is decided once,
        here, outside the layer scan: first chunks on rank 0 start the sequence, and with packed documents a
        predecessor token of another document reads as the sequence start."""
        rank = lax.axis_index(self.axis)
        is_second = jnp.tile(jnp.array([False, True]), n_rows // 2)
        has_left = is_second | (rank > 0)
        if seg_rows is None:
            keep_conv, keep_value = has_left[:, None], has_left
        else:
            width = max(halo, 1)
            prev_seg = self._neighbour(seg_rows[:, -width:])  # segment ids of the predecessor's last tokens
            same = prev_seg == seg_rows[:, :1]
            keep_conv, keep_value = has_left[:, None] & same[:, width - halo:], has_left & same[:, -1]

        def exchange(tail: CCAState, start: CCAState) -> CCAState:
            incoming = jax.tree.map(self._neighbour, tail)
            return CCAState(conv=jnp.where(keep_conv[..., None], incoming.conv, start.conv),
                            value=jnp.where(keep_value[:, None], incoming.value, start.value))

        return exchange

    def _attend_fn(self, order, segment_ids):
        variant = self._ring if self.attention == "ring" else self._allgather

        def attend(q, k, v):
            return self.rows(variant(self.seq(q), self.seq(k), self.seq(v), order, segment_ids))

        return attend

    # ---- attention variants: q [b, 2c, H, d], k/v [b, 2c, KV, d] (this rank's share) ----------------------
    def _allgather(self, q, k, v, order, seg):
        ax, b = self.axis, q.shape[0]
        k_all = lax.all_gather(k, ax, axis=1, tiled=True)  # [b, S, KV, d], zigzag layout order
        v_all = lax.all_gather(v, ax, axis=1, tiled=True)
        kv_order = jnp.broadcast_to(jnp.asarray(self.zigzag.order()), (b, self.zigzag.seq_len))
        seg_all = None if seg is None else lax.all_gather(seg, ax, axis=1, tiled=True)
        return attention_ops.attention(q, k_all, v_all, impl=self.impl, q_positions=order, kv_positions=kv_order,
                                       q_segment_ids=seg, kv_segment_ids=seg_all)

    def _block(self, q, k, v, q_order, kv_order, q_seg, kv_seg):
        impl = self.impl if self.impl in ("xla", "pallas") else "xla"  # cuDNN returns no log-sum-exp to merge by
        o, lse = attention_ops.attention_with_lse(q, k, v, impl=impl, q_positions=q_order,
                                                  kv_positions=kv_order, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
        return o.astype(jnp.float32), lse

    def _ring(self, q, k, v, order, seg):
        cp, ax, c, b = self.zigzag.cp, self.axis, self.zigzag.chunk, q.shape[0]
        rank = lax.axis_index(ax)
        q_seg_late = None if seg is None else seg[:, c:]
        perm = [(i, (i + 1) % cp) for i in range(cp)]

        def visit(block, step):
            """Partial attention of our queries on the K/V block that started on rank (r - step) mod cp."""
            k_b, v_b, seg_b = block
            source = (rank - step) % cp
            kv_order = self.order_of(source, b)

            def earlier(k_b, v_b, seg_b):  # source rank < ours: its first chunk precedes both of ours
                return self._block(q, k_b[:, :c], v_b[:, :c], order, kv_order[:, :c], seg,
                                   None if seg_b is None else seg_b[:, :c])

            def later(k_b, v_b, seg_b):  # source rank > ours: only our second chunk sees it, all of it
                o2, lse2 = self._block(q[:, c:], k_b, v_b, order[:, c:], kv_order, q_seg_late, seg_b)
                return (jnp.concatenate([jnp.zeros_like(o2), o2], axis=1),
                        jnp.concatenate([jnp.full_like(lse2, _NEG), lse2], axis=2))

            return lax.cond(source < rank, earlier, later, k_b, v_b, seg_b)

        local = (k, v, seg)
        incoming = lax.ppermute(local, ax, perm) if cp > 1 else None  # in flight during the local block
        o, lse = self._block(q, k, v, order, order, seg, seg)

        def step_fn(carry, step):
            o, lse, current = carry
            following = lax.ppermute(current, ax, perm)  # the next block's transfer overlaps this block's math
            o, lse = _merge(o, lse, *visit(current, step))
            return (o, lse, following), None

        if cp > 2:
            (o, lse, incoming), _ = lax.scan(step_fn, (o, lse, incoming), jnp.arange(1, cp - 1))
        if cp > 1:  # the last block: nothing left to send
            o, lse = _merge(o, lse, *visit(incoming, cp - 1))
        return o.astype(q.dtype)


def _merge(o_a, lse_a, o_b, lse_b):
    """Softmax-weighted merge of two partial attentions over disjoint key sets; o [b, T, H, d], lse [b, H, T]."""
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a = jnp.exp(lse_a - lse).transpose(0, 2, 1)[..., None]
    w_b = jnp.exp(lse_b - lse).transpose(0, 2, 1)[..., None]
    return o_a * w_a + o_b * w_b, lse


# ---- whole-batch entry points (outside shard_map) ------------------------------------------------------------

def batch_specs(mesh, batch_axes=("data",)):
    """Specs of the zigzag-laid-out batch: [B, S] fields over (batch axes, context), [B] fields over batch axes."""
    seq = P(batch_axes, "context") if "context" in mesh.axis_names else P(batch_axes)
    return seq, P(batch_axes)


def forward_logits(graphdef, params, model_state, input_ids, mesh, cp: ContextParallel, *, positions=None,
                   segment_ids=None):
    """Logits [B, S, V] in sequence order from a context-parallel forward (for tests and evaluation)."""
    zz = cp.zigzag
    seq_spec, _ = batch_specs(mesh)

    def local(params, model_state, fields):
        model = nnx.merge(graphdef, params, model_state)
        logits, _ = cp.local_forward(model, fields["inputs"], fields.get("positions"), fields.get("segment_ids"))
        return cp.seq(logits)

    fields = {k: to_layout(x, zz) for k, x in (("inputs", input_ids), ("positions", positions),
                                               ("segment_ids", segment_ids)) if x is not None}
    out = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), seq_spec), out_specs=seq_spec)(params, model_state,
                                                                                            fields)
    return from_layout(out, zz)

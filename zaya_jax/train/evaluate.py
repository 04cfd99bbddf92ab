"""Jit-compiled held-out evaluation: loss and perplexity per source (one compiled step for every batch), and the
expert loads of the held-out forward (eval_max_load, eval_min_load, eval_dead_experts: the worst layer). Evaluation
routes as inference and a Hugging Face export do, with the stored balancing biases alone, where training balances
every microbatch (docs/routing.md), so these show how balanced the run routes when it is used."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zaya_jax.data import DataError, PackedSource, eval_batches
from zaya_jax.optim.balancing import routing_health
from zaya_jax.train.step import make_eval_step


class Evaluator:
    def __init__(self, graphdef, sources: dict[str, str], *, seq_len: int, rows: int, mesh, max_batches: int | None,
                 reset_at_documents: bool = False):
        self.names = sorted(sources)
        self.sources = [PackedSource(n, sources[n], seq_len) for n in self.names]
        for src in self.sources:
            if src.num_windows < 1:  # it would score as loss 0, perplexity 1
                raise DataError(f"held-out source {src.name!r} holds {src.num_tokens} tokens, fewer than one row of "
                                f"data.seq_len + 1 = {seq_len + 1}: nothing to score")
        self.rows, self.max_batches = rows, max_batches
        self.sharding = NamedSharding(mesh, P("data"))
        self.step = jax.jit(make_eval_step(graphdef, len(self.names), reset_at_documents=reset_at_documents))

    def __call__(self, params, model_state) -> dict[str, float]:
        """Loss and perplexity per source and over all of them ({} without held-out sources)."""
        if not self.names:
            return {}
        loss_sum = np.zeros(len(self.names))
        count = np.zeros(len(self.names))
        routed = 0.0
        for i, src in enumerate(self.sources):
            for b in eval_batches(src, self.rows, rank=jax.process_index(), num_ranks=jax.process_count(),
                                  max_batches=self.max_batches, source_id=i):
                batch = {k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in b.items()}
                s, c, r = self.step(params, model_state, batch)
                loss_sum += np.asarray(s)
                count += np.asarray(c)
                routed = routed + np.asarray(r, np.float64)
        out = {}
        for i, name in enumerate(self.names):
            loss = loss_sum[i] / max(count[i], 1.0)
            out[f"eval_loss_{name}"] = loss
            out[f"eval_ppl_{name}"] = math.exp(min(loss, 50.0))
        total = loss_sum.sum() / max(count.sum(), 1.0)
        out["eval_loss"] = total
        health = routing_health(jnp.asarray(routed, jnp.float32))  # the worst layer, as the train metrics show
        out.update(eval_max_load=float(jnp.max(health.max_load)), eval_min_load=float(jnp.min(health.min_load)),
                   eval_dead_experts=float(jnp.max(health.dead_experts)))
        return out

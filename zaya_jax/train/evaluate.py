"""Jit-compiled held-out evaluation: loss and perplexity per source (one compiled step for every batch)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zaya_jax.data import PackedSource, eval_batches
from zaya_jax.train.step import make_eval_step


class Evaluator:
    def __init__(self, graphdef, sources: dict[str, str], *, seq_len: int, rows: int, mesh, max_batches: int | None,
                 reset_at_documents: bool = False):
        self.names = sorted(sources)
        self.sources = [PackedSource(n, sources[n], seq_len) for n in self.names]
        self.rows, self.max_batches = rows, max_batches
        self.sharding = NamedSharding(mesh, P("data"))
        self.step = jax.jit(make_eval_step(graphdef, len(self.names), reset_at_documents=reset_at_documents))

    def __call__(self, params, model_state) -> dict[str, float]:
        loss_sum = np.zeros(len(self.names))
        count = np.zeros(len(self.names))
        for i, src in enumerate(self.sources):
            for b in eval_batches(src, self.rows, rank=jax.process_index(), num_ranks=jax.process_count(),
                                  max_batches=self.max_batches, source_id=i):
                batch = {k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in b.items()}
                s, c = self.step(params, model_state, batch)
                loss_sum += np.asarray(s)
                count += np.asarray(c)
        out = {}
        for i, name in enumerate(self.names):
            loss = loss_sum[i] / max(count[i], 1.0)
            out[f"eval_loss_{name}"] = loss
            out[f"eval_ppl_{name}"] = math.exp(min(loss, 50.0))
        total = loss_sum.sum() / max(count.sum(), 1.0)
        out["eval_loss"] = total
        return out


def evaluate_checkpoint(config, workdir: str, *, step: int | None = None, max_batches: int | None = None,
                        log=print) -> dict[str, float]:
    """Scores the run's checkpoint (latest, or `step`) on every held-out source; jit-compiled, any mesh.
    `config` None: the one recorded in the run directory (run_record.py)."""
    import os

    from zaya_jax.checkpoint.manager import abstract_like
    from zaya_jax.train import run_record
    from zaya_jax.train.loop import checkpoint_manager, setup

    if config is None:
        config = run_record.load_config(workdir)
    s = setup(config, log=log)
    ckpt = checkpoint_manager(config, workdir)
    try:
        restored = ckpt.restore(abstract_like(s.state), step=step, expect_meta=s.meta, log=log)
    finally:  # its background threads must not outlive a failed restore
        ckpt.close()
    params, model_state = restored.state["params"], restored.state["model_state"]
    evaluator = Evaluator(s.graphdef, s.valid_sources, seq_len=s.plan.seq_len, rows=s.plan.micro_rows, mesh=s.mesh,
                          max_batches=max_batches, reset_at_documents=bool(config.data.reset_at_documents))
    out = evaluator(params, model_state)
    log(f"{os.path.join(workdir, 'checkpoints')} step {restored.step}: " +
        " ".join(f"{k}={v:.4f}" for k, v in out.items()))
    return {"step": restored.step, **out}

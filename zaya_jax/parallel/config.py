"""How the trainer parallelises, beyond the mesh shape (config group `parallel`; every key optional; built and
checked from the run config by zaya_jax/train/options.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    zero1: bool = True  # shard the optimizer state over the batch axes (nothing to shard on one device)
    muon_placement: str = "whole_matrix"  # Newton-Schulz under ZeRO-1: 'whole_matrix' | 'all_gathered' (baseline)
    context_attention: str = "allgather"  # with mesh.context > 1: 'allgather' (K/V) | 'ring' (ppermute K/V)
    bucket_bytes: int = 0  # gradient bucket = XLA collective combine threshold (GPU); 0 = XLA's default

"""A weighted mixture of packed sources with a deterministic, random-access order.

Global sequence g (0, 1, 2, ... over the whole run) maps to one window of one source, as a pure function of
(seed, sources, weights, block_size) -- no state, no history -- which is what makes resume exact at any batch
size or data-parallel layout:

1. Blocks. Sequences are grouped in blocks of `block_size`. Every block holds exactly `count[s]` sequences of
   source s (weights * block_size, rounded by largest remainder), so the mixture is exact per block.
2. Within block b, position p goes to slot permute(p; seed, b); slots [0, count[0]) belong to the first
   source, the next count[1] to the second, and so on. The slot's rank inside its source's range gives the
   source-local index u = b * count[s] + rank: every source is consumed 0, 1, 2, ... without gaps or repeats.
3. u -> epoch u // n_s and window permute(u % n_s; seed, s, epoch): a fresh shuffle of the source's windows
   every epoch, so a small source repeats in a new order rather than the same one.

Weights are per sequence, i.e. per token since all rows have the same length. A weight below
1 / block_size may round to zero sequences per block; raise block_size for such mixtures.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np

from zaya_jax.data.errors import DataError
from zaya_jax.data.packing import PackedSource, empty_rows, fill_row
from zaya_jax.data.permutation import derive_key, permute

DEFAULT_BLOCK_SIZE = 1024


def block_counts(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Sequences per source in one block: largest-remainder rounding of weights * block_size (ties: order).

    Exact rational arithmetic, so the counts never depend on floating-point rounding."""
    exact = [Fraction(w) * block_size / sum(map(Fraction, weights)) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:block_size - sum(counts)]:
        counts[i] += 1
    return np.asarray(counts, dtype=np.int64)


class Blend:
    """Global sequence index -> (source, window) for a weighted mixture of sources.

    Args:
        sources: the packed sources; they are ordered by name, and `source_ids` in batches index that order.
        weights: source name -> non-negative weight (normalised here); every source needs one.
        seed: the data seed; any change gives a different order.
        block_size: sequences per mixing block (see the module docstring).
    """

    def __init__(self, sources: Sequence[PackedSource], weights: Mapping[str, float], seed: int,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.sources = sorted(sources, key=lambda s: s.name)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise DataError(f"duplicate source names in {names}")
        if set(weights) != set(names):
            raise DataError(f"mixture weights name {sorted(weights)} but the sources are {names}")
        self.weights = [float(weights[n]) for n in names]
        if any(w < 0 or not np.isfinite(w) for w in self.weights) or sum(self.weights) <= 0:
            raise DataError(f"mixture weights must be finite, non-negative and not all zero: {dict(weights)}")
        self.seq_len = self.sources[0].seq_len
        if any(s.seq_len != self.seq_len for s in self.sources):
            raise DataError(f"sources packed with different seq_len: {[(s.name, s.seq_len) for s in self.sources]}")
        self.seed, self.block_size = int(seed), int(block_size)
        self.counts = block_counts(self.weights, self.block_size)
        self.slot_starts = np.concatenate([[0], np.cumsum(self.counts)])
        for source, count in zip(self.sources, self.counts):
            if count and source.num_windows == 0:
                raise DataError(f"source {source.name!r}: {source.num_tokens} tokens, fewer than one row of "
                                f"seq_len + 1 = {self.seq_len + 1}")
        self.fingerprint = self._fingerprint()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def _fingerprint(self) -> str:
        """Changes whenever the global order would: seed, seq_len, block size, weights, source contents."""
        spec = {"seed": self.seed, "seq_len": self.seq_len, "block_size": self.block_size,
                "counts": self.counts.tolist(), "sources": [s.describe() for s in self.sources]}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def locate(self, sequences) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window) of each global sequence index, as two int64 arrays."""
        g = np.asarray(sequences, dtype=np.int64).reshape(-1)
        if g.size and g.min() < 0:
            raise IndexError("negative global sequence index")
        block, position = np.divmod(g, self.block_size)
        slot = np.empty_like(g)
        for b in np.unique(block):
            here = block == b
            slot[here] = permute(position[here], self.block_size, derive_key(self.seed, "block", int(b)))
        source = np.searchsorted(self.slot_starts, slot, side="right") - 1
        local = block * self.counts[source] + (slot - self.slot_starts[source])
        window = np.empty_like(g)
        for s in np.unique(source):
            mine = source == s
            n = self.sources[s].num_windows
            epoch, index = np.divmod(local[mine], n)
            out = np.empty_like(index)
            for e in np.unique(epoch):
                this = epoch == e
                out[this] = permute(index[this], n, derive_key(self.seed, "order", self.sources[s].name, int(e)))
            window[mine] = out
        return source, window

    def rows(self, first: int, count: int) -> dict[str, np.ndarray]:
        """Batch fields of global sequences [first, first + count), plus `source_ids` (int32[count])."""
        source, window = self.locate(np.arange(first, first + count))
        out = empty_rows(count, self.seq_len)
        for i, (s, q) in enumerate(zip(source.tolist(), window.tolist())):
            fill_row(out, i, *self.sources[s].window(q))
        out["source_ids"] = source.astype(np.int32)
        return out

"""Packing documents into fixed-length rows for next-token training.

A source's indexed datasets are read as one token stream (files in the order given, documents in file order,
each ending with eos when written by zaya_jax.data.prepare). Window q of the stream is tokens
[q*L, q*L + L + 1): L inputs plus the one extra token their last target needs, so consecutive windows share
one token and no token is dropped except the stream's tail. Order comes later, from a permutation of window
numbers (see blend.py); windows are read sequentially from the mmapped .bin, the cheapest access pattern.

A row of a batch (all arrays of length L, the model's seq_len):
    inputs       int32    window[:-1]
    targets      int32    window[1:]
    loss_mask    float32  1 where the target belongs to the same document as the input, 0 across a boundary
    segment_ids  int32    1, 2, ... for the documents in the row, in order (0 is reserved for padding)
    positions    int32    position within the row's part of the document, 0 at every document start
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

import numpy as np

from zaya_jax.data.errors import DataError
from zaya_jax.data.indexed import IndexedDataset

ROW_FIELDS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


class PackedSource:
    """One named source (e.g. "web") of one or more indexed datasets, cut into windows of seq_len + 1 tokens.

    Args:
        name: the source's name in mixtures, metrics and errors.
        prefixes: one indexed-dataset prefix or a list of them (read as one stream, in this order).
        seq_len: tokens per row L.
    """

    def __init__(self, name: str, prefixes: str | Sequence[str], seq_len: int):
        if seq_len < 1:
            raise DataError(f"source {name!r}: seq_len must be positive, got {seq_len}")
        self.name, self.seq_len = name, int(seq_len)
        self.prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
        if not self.prefixes:
            raise DataError(f"source {name!r}: no indexed datasets given")
        self.datasets = [IndexedDataset(p) for p in self.prefixes]
        for ds in self.datasets:
            if not np.issubdtype(ds.dtype, np.integer):
                raise DataError(f"{ds.idx_path}: source {name!r} holds {ds.dtype} values, not token ids")
        self.file_starts = np.cumsum([0] + [ds.num_tokens for ds in self.datasets]).tolist()
        self.num_tokens = self.file_starts[-1]
        self.num_windows = max(0, (self.num_tokens - 1) // self.seq_len)

    def describe(self) -> dict:
        """What identifies this source's content (file names, sizes, dtypes; not absolute paths)."""
        return {"name": self.name, "files": [[os.path.basename(p), ds.num_tokens, len(ds), str(ds.dtype)]
                                             for p, ds in zip(self.prefixes, self.datasets)]}

    def window(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (int32[L+1]) of window `q` and a mask (bool[L+1]) that is True where a document starts."""
        if not 0 <= q < self.num_windows:
            raise IndexError(f"source {self.name!r}: window {q} out of range (have {self.num_windows})")
        size = self.seq_len + 1
        start = q * self.seq_len
        stop = start + size
        tokens = np.empty(size, np.int32)
        starts = np.zeros(size, bool)
        f = bisect.bisect_right(self.file_starts, start) - 1
        at = start
        while at < stop:  # a window may span the end of one file and the start of the next
            ds, base = self.datasets[f], self.file_starts[f]
            lo, hi = at - base, min(stop, self.file_starts[f + 1]) - base
            tokens[at - start:at - start + hi - lo] = ds.tokens(lo, hi)
            pointers, itemsize = ds.sequence_pointers, ds.dtype.itemsize
            # bisect on the mmapped (unaligned) pointers: O(log S) reads, where np.searchsorted would copy them
            first = bisect.bisect_left(pointers, lo * itemsize)
            last = bisect.bisect_left(pointers, hi * itemsize)
            starts[np.asarray(pointers[first:last]) // itemsize - lo + (at - start)] = True
            at, f = base + hi, f + 1
        starts[0] = True
        return tokens, starts

    def rows(self, windows: Sequence[int]) -> dict[str, np.ndarray]:
        """The batch fields (see the module docstring) of the given windows, stacked in order."""
        out = empty_rows(len(windows), self.seq_len)
        for i, q in enumerate(windows):
            fill_row(out, i, *self.window(int(q)))
        return out


def empty_rows(n: int, seq_len: int) -> dict[str, np.ndarray]:
    """n padding rows: zeros everywhere, so loss_mask 0 and segment 0."""
    fields = {name: np.zeros((n, seq_len), np.int32) for name in ROW_FIELDS}
    fields["loss_mask"] = np.zeros((n, seq_len), np.float32)
    return fields


def fill_row(out: dict[str, np.ndarray], i: int, tokens: np.ndarray, starts: np.ndarray):
    segments = np.cumsum(starts, dtype=np.int32)
    index = np.arange(len(tokens), dtype=np.int32)
    segment_start = np.maximum.accumulate(np.where(starts, index, 0))
    out["inputs"][i] = tokens[:-1]
    out["targets"][i] = tokens[1:]
    out["loss_mask"][i] = segments[1:] == segments[:-1]
    out["segment_ids"][i] = segments[:-1]
    out["positions"][i] = (index - segment_start)[:-1]

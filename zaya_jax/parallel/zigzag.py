"""Zigzag (load-balanced) sequence layout for context parallelism.

A sequence of S tokens is cut into 2·CP chunks of c = S / (2·CP); context rank r holds chunks r and 2·CP-1-r,
so every rank gets one early and one late chunk and the causal attention work is the same on every rank.
The layout is a permutation of the sequence axis: `order()[j]` is the sequence position stored at layout slot j,
and rank r's contiguous share of the layout is [chunk r | chunk 2·CP-1-r].
"""

from __future__ import annotations

import dataclasses

import numpy as np


class ZigzagError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Zigzag:
    cp: int  # context-parallel ranks
    seq_len: int

    def __post_init__(self):
        if self.cp < 1 or self.seq_len % (2 * self.cp):
            raise ZigzagError(f"seq_len={self.seq_len} must split into 2*context={2 * self.cp} equal chunks")

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def chunks_of(self, rank):
        """The two chunk indices rank r holds (works on ints and on traced axis indices)."""
        return rank, 2 * self.cp - 1 - rank

    def order(self) -> np.ndarray:
        """[S] int32: sequence position held at each layout slot."""
        c = self.chunk
        ids = [j for r in range(self.cp) for j in self.chunks_of(r)]
        return np.concatenate([np.arange(j * c, (j + 1) * c) for j in ids]).astype(np.int32)

    def inverse(self) -> np.ndarray:
        """[S] int32: layout slot of each sequence position (undoes `order`)."""
        return np.argsort(self.order()).astype(np.int32)


def to_layout(x, zz: Zigzag, axis: int = 1):
    """Permutes the sequence axis of x into the zigzag layout (a gather; works on numpy and jax arrays)."""
    return x.take(zz.order(), axis=axis)


def from_layout(x, zz: Zigzag, axis: int = 1):
    return x.take(zz.inverse(), axis=axis)

"""Bandwidth bookkeeping with the nccl-tests conventions, so our numbers compare with theirs.

`size` is the bytes of the whole logical buffer a rank sees: the per-rank buffer for all-reduce, broadcast and
all-to-all; the per-rank *input* (n x the output) for reduce-scatter; the per-rank *output* (n x the input) for
all-gather. Algorithm bandwidth is size / time. Bus bandwidth multiplies it by the fraction of the buffer each
rank must move over its slowest link in an optimal algorithm, which makes it comparable to the link's rate and
independent of n: 2(n-1)/n for all-reduce (reduce-scatter then all-gather), (n-1)/n for reduce-scatter,
all-gather and all-to-all (each rank keeps 1/n of the data), 1 for broadcast (the root's buffer crosses once).
"""

from __future__ import annotations

COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


def bus_factor(collective: str, n: int) -> float:
    if n < 1:
        raise ValueError(f"device count must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; known: {COLLECTIVE_NAMES}")


def algbw(size_bytes: float, seconds: float) -> float:
    """Bytes per second of the logical buffer."""
    return size_bytes / seconds


def busbw(collective: str, n: int, size_bytes: float, seconds: float) -> float:
    return algbw(size_bytes, seconds) * bus_factor(collective, n)


def per_rank_buffers(collective: str, n: int, size_bytes: int) -> tuple[int, int]:
    """(input bytes, output bytes) on each rank for a collective of logical `size_bytes`."""
    if collective == "reduce_scatter":
        return size_bytes, size_bytes // n
    if collective == "all_gather":
        return size_bytes // n, size_bytes
    bus_factor(collective, n)  # validates the name
    return size_bytes, size_bytes

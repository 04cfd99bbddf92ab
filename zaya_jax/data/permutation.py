"""A keyed pseudo-random permutation of [0, n) evaluated per index, in O(1) memory (a Feistel network with
cycle walking, the construction Levanter's loader uses).

The data order of every run depends on these exact bits, so they are ours: a change here changes which
batches a resumed run reads, and the golden values in tests/test_data_permutation.py pin them.
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijective avalanche hash of uint64 values (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from integers and strings (stable across processes, unlike Python's hash())."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def permute(index, n: int, key: int) -> np.ndarray:
    """The images of `index` (ints in [0, n)) under the permutation of [0, n) named by `key` (int64 array)."""
    index = np.asarray(index, dtype=np.int64)
    if n <= 0:
        raise ValueError(f"permutation of an empty range (n={n})")
    if index.size and (index.min() < 0 or index.max() >= n):
        raise IndexError(f"index outside [0, {n})")
    if n == 1:
        return np.zeros_like(index)
    half = ((n - 1).bit_length() + 1) // 2  # the Feistel domain 4**half is at least n and below 4n
    round_keys = mix64(np.arange(1, _ROUNDS + 1, dtype=np.uint64) * np.uint64(_GOLDEN) ^ np.uint64(key))
    x = index.reshape(-1).astype(np.uint64)  # 1-D: numpy scalars would warn on the intended wrap-around
    out = _feistel(x, half, round_keys)
    # cycle walking: values that land outside [0, n) are permuted again until they come back inside
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = _feistel(out[outside], half, round_keys)
        outside = out >= np.uint64(n)
    return out.astype(np.int64).reshape(index.shape)


def _feistel(x: np.ndarray, half: int, round_keys: np.ndarray) -> np.ndarray:
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for k in round_keys:
        left, right = right, left ^ (mix64(right ^ k) & mask)
    return (left << shift) | right

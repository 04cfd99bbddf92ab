"""Which key blocks each query block must visit (and the reverse), computed once per call outside the kernels.

Visibility of key s to query t: kv_pos[s] <= q_pos[t], optionally q_pos[t] - kv_pos[s] < window, and equal
segment ids. Padding keys carry position INT32_MAX (never visible) and padding queries position -1 (see nothing).
From per-block bounding boxes of positions and segment ids we get, for every (query block, key block) pair,
`needed` (some pair may be visible) and `full` (every pair is visible, so the kernel may skip the mask).

Each kernel program then runs over the block range [lo, hi) in three loops: masked [lo, u0), unmasked [u0, u1),
masked [u1, hi), where [u0, u1) is a run of full blocks. With causal positions that run is everything left of
the diagonal, so only the diagonal blocks pay for masking. Any positions (zigzag chunks, packed documents,
padding) stay correct: blocks in the range that are not needed are masked away element by element.

With no position, segment or padding arrays the ranges are static and computed with numpy at trace time.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

KV_PAD_POSITION = np.iinfo(np.int32).max
Q_PAD_POSITION = -1


def _block_stats(x, block, xp):
    b, n = x.shape
    x = x.reshape(b, n // block, block)
    return x.min(axis=-1), x.max(axis=-1)


def visibility(q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k, xp):
    """-> (needed, full): bool [B, nq, nk]."""
    q_min, q_max = _block_stats(q_pos, block_q, xp)
    k_min, k_max = _block_stats(kv_pos, block_k, xp)
    k_real = xp.where(kv_pos == KV_PAD_POSITION, -1, kv_pos)  # largest real key position per block
    _, k_max_real = _block_stats(k_real, block_k, xp)
    q_min, q_max = q_min[:, :, None], q_max[:, :, None]
    k_min, k_max, k_max_real = k_min[:, None, :], k_max[:, None, :], k_max_real[:, None, :]
    needed = k_min <= q_max
    full = k_max <= q_min
    if window is not None:
        needed = needed & ((q_min - k_max_real) < window)
        full = full & ((q_max - k_min) < window)
    if q_seg is not None:
        qs_min, qs_max = (s[:, :, None] for s in _block_stats(q_seg, block_q, xp))
        ks_min, ks_max = (s[:, None, :] for s in _block_stats(kv_seg, block_k, xp))
        needed = needed & (qs_min <= ks_max) & (ks_min <= qs_max)
        full = full & (qs_min == qs_max) & (ks_min == ks_max) & (qs_min == ks_min)
    return needed, full & needed


def loop_ranges(needed, full, xp):
    """Reduces [..., n] needed/full rows to int32 [..., 4] = (lo, u0, u1, hi) as described in the module doc."""
    n = needed.shape[-1]
    idx = xp.arange(n, dtype=np.int32)
    any_needed = needed.any(axis=-1)
    lo = xp.where(any_needed, xp.argmax(needed, axis=-1), 0).astype(np.int32)
    hi = xp.where(any_needed, n - xp.argmax(needed[..., ::-1], axis=-1), 0).astype(np.int32)
    any_full = full.any(axis=-1)
    u1 = xp.where(any_full, n - xp.argmax(full[..., ::-1], axis=-1), lo).astype(np.int32)
    last_gap = xp.where(~full & (idx < u1[..., None]), idx, -1).max(axis=-1)  # last non-full block before u1
    u0 = xp.where(any_full, last_gap + 1, lo).astype(np.int32)
    u0 = xp.maximum(u0, lo)
    return xp.stack([lo, u0, u1, hi], axis=-1).astype(np.int32)


def ranges(q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k, *, per_kv_block: bool, static: bool,
           as_numpy: bool = False):
    """Loop ranges per query block ([B, nq, 4] over key blocks) or per key block ([B, nk, 4] over query blocks);
    static ones as a NumPy array with as_numpy (sizes derived from them at trace time)."""
    xp = np if static else jnp
    if static:
        q_pos, kv_pos = np.asarray(q_pos), np.asarray(kv_pos)
    needed, full = visibility(q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k, xp)
    if per_kv_block:
        needed, full = needed.transpose(0, 2, 1), full.transpose(0, 2, 1)
    out = loop_ranges(needed, full, xp)
    return out if not static or as_numpy else jnp.asarray(out)

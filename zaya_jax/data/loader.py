"""The training iterator: step-indexed global batches, this rank's slice of each, prefetched in the background,
with a small JSON-able state for checkpoints; and the evaluation batches of a held-out source.

Step k's global batch is global sequences [c_k, c_k + B) of the Blend, where B is the global batch in rows and
c_k = c_0 + (k - k_0) * B counts from the position (k_0, c_0) the iterator started at. With a fixed B from
step 0 that is c_k = k * B: batch k is a pure function of (data seed, k, B). Rank r of R data-parallel ranks
(or hosts) receives rows [r * B/R, (r+1) * B/R) of it, so the global batch never depends on R.

The state is {"version", "step", "sequence", "fingerprint"}: the next step, the first global sequence it
reads, and the Blend's fingerprint (a restore into a different data configuration is refused). Because the
state holds the sequence cursor, a run may resume with a different global batch and continue the stream
exactly where it stopped; batch-size ramps work the same way (start a new iterator from `state()` with the new
B at the ramp step; a resumed run must do the same at the same steps).

Prefetch uses grain (MapDataset over step numbers + ReadOptions threads); it changes when batches are made,
never what they hold.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from zaya_jax.data.blend import DEFAULT_BLOCK_SIZE, Blend
from zaya_jax.data.errors import DataError
from zaya_jax.data.packing import PackedSource, empty_rows

STATE_VERSION = 1
_NO_END = 2**62  # grain datasets need a length; no run reaches this many steps


class TrainIterator:
    """This rank's batches of a Blend, one per training step, as dicts of numpy arrays.

    Each batch holds `rows = global_batch // num_ranks` rows: inputs, targets, loss_mask, segment_ids, positions
    (all [rows, seq_len]; see packing.py) and source_ids ([rows], index into `blend.names`).

    Args:
        blend: the mixture to read.
        global_batch: rows per step across all ranks (tokens per step = global_batch * seq_len).
        rank, num_ranks: this data-parallel rank (or host) and how many there are; global_batch % num_ranks == 0.
        state: a dict from `state()` to resume from; None starts at step 0, sequence 0.
        prefetch: batches made ahead in the background (0: made on demand in the caller's thread).
        num_threads: background threads making batches.
        vocab_size: if given, a batch holding an id >= vocab_size raises DataError naming its source.
    """

    def __init__(self, blend: Blend, *, global_batch: int, rank: int = 0, num_ranks: int = 1,
                 state: Mapping | None = None, prefetch: int = 4, num_threads: int = 1,
                 vocab_size: int | None = None):
        if global_batch < 1 or num_ranks < 1 or global_batch % num_ranks:
            raise DataError(f"global batch {global_batch} does not split into {num_ranks} equal rank slices")
        if not 0 <= rank < num_ranks:
            raise DataError(f"rank {rank} outside [0, {num_ranks})")
        self.blend, self.global_batch, self.rank, self.num_ranks = blend, global_batch, rank, num_ranks
        self.rows_per_rank = global_batch // num_ranks
        self.vocab_size = vocab_size
        self._start_step, self._start_sequence = self._check_state(state) if state is not None else (0, 0)
        self._step = self._start_step
        self._prefetched = self._prefetch(prefetch, num_threads) if prefetch > 0 else None

    # ---- position -----------------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The step whose batch the next call to next() returns."""
        return self._step

    def first_sequence(self, step: int) -> int:
        """The global sequence that starts step `step`'s global batch."""
        return self._start_sequence + (step - self._start_step) * self.global_batch

    def state(self) -> dict:
        """Where the next batch comes from; save it with the checkpoint of the step just taken."""
        return {"version": STATE_VERSION, "step": self._step, "sequence": self.first_sequence(self._step),
                "fingerprint": self.blend.fingerprint}

    def _check_state(self, state: Mapping) -> tuple[int, int]:
        if state.get("version") != STATE_VERSION or not {"step", "sequence", "fingerprint"} <= set(state):
            raise DataError(f"not a data-iterator state of version {STATE_VERSION}: {dict(state)}")
        if state["fingerprint"] != self.blend.fingerprint:
            raise DataError(f"the saved data position belongs to another data configuration (fingerprint "
                            f"{state['fingerprint']}, this run {self.blend.fingerprint}: seed, seq_len, weights, "
                            f"block size or source files differ); resuming would not read the same batches")
        return int(state["step"]), int(state["sequence"])

    # ---- batches ------------------------------------------------------------------------------------------------
    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This rank's batch of `step` (a pure function of the step; does not move the iterator)."""
        first = self.first_sequence(step) + self.rank * self.rows_per_rank
        rows = self.blend.rows(first, self.rows_per_rank)
        if self.vocab_size is not None:
            self._check_vocab(rows, step)
        return rows

    def _check_vocab(self, rows: dict, step: int):
        outside = (rows["inputs"] >= self.vocab_size) | (rows["targets"] >= self.vocab_size)
        too_big = np.flatnonzero(outside.any(axis=1))
        if too_big.size:
            source = self.blend.names[rows["source_ids"][too_big[0]]]
            high = int(max(rows["inputs"].max(), rows["targets"].max()))
            raise DataError(f"source {source!r}: token id {high} at step {step} is outside the model's vocab of "
                            f"{self.vocab_size} (tokenized with another tokenizer?)")

    def _prefetch(self, depth: int, num_threads: int) -> Iterator[dict]:
        import grain  # the background reader; only needed when prefetching

        steps = grain.MapDataset.range(self._start_step, _NO_END).map(self.batch)
        options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=depth)
        return iter(steps.to_iter_dataset(options))

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = next(self._prefetched) if self._prefetched is not None else self.batch(self._step)
        self._step += 1
        return out

    def close(self):
        """Stops the background threads; later batches are made on demand. Also done on garbage collection."""
        if self._prefetched is not None:
            self._prefetched.close()
            self._prefetched = None


def train_iterator(sources: Mapping[str, str | Sequence[str]], weights: Mapping[str, float], *, seq_len: int,
                   global_batch: int, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE, **kwargs) -> TrainIterator:
    """TrainIterator over `sources` (name -> indexed-dataset prefix or list of prefixes) mixed by `weights`.

    Other keyword arguments (rank, num_ranks, state, prefetch, num_threads, vocab_size) go to TrainIterator.
    """
    packed = [PackedSource(name, prefixes, seq_len) for name, prefixes in sources.items()]
    return TrainIterator(Blend(packed, weights, seed, block_size), global_batch=global_batch, **kwargs)


def eval_batches(source: PackedSource, global_batch: int, *, rank: int = 0, num_ranks: int = 1,
                 max_batches: int | None = None, source_id: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """A held-out source's windows in order, as this rank's slices of global batches of `global_batch` rows.

    Every window appears once (up to `max_batches` batches); the last batch is filled with padding rows
    (loss_mask 0, source_ids -1; real rows carry `source_id`) so every batch has the same shape and one
    compiled eval step serves all.
    """
    if global_batch % num_ranks:
        raise DataError(f"eval batch {global_batch} does not split into {num_ranks} equal rank slices")
    rows = global_batch // num_ranks
    num_batches = -(-source.num_windows // global_batch)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for b in range(num_batches):
        first = b * global_batch + rank * rows
        windows = list(range(first, min(first + rows, source.num_windows)))
        out = empty_rows(rows, source.seq_len)
        if windows:
            for k, v in source.rows(windows).items():
                out[k][:len(windows)] = v
        out["source_ids"] = np.where(np.arange(rows) < len(windows), source_id, -1).astype(np.int32)
        yield out

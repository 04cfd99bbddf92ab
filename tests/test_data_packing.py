"""Packing documents into seq_len + 1 windows with segment ids, positions and a boundary-aware loss mask."""

import numpy as np
import pytest

from zaya_jax.data import DataError, PackedSource, write_indexed_dataset


def _files(tmp_path, rng, num_files=3):
    """Files of random documents (some empty, some longer than a row); returns prefixes and the documents."""
    prefixes, docs = [], []
    for f in range(num_files):
        lengths = rng.choice([0, 1, 2, 5, 9, 23, 40], size=12)
        file_docs = [rng.integers(3, 500, size=n) for n in lengths]
        prefixes.append(write_indexed_dataset(str(tmp_path / f"f{f}"), file_docs, np.uint16))
        docs += file_docs
    return prefixes, docs


def _reference_row(docs, seq_len, q):
    """Brute force: label every stream token with its document, cut window q, renumber."""
    stream = np.concatenate(docs)
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    lo, hi = q * seq_len, q * seq_len + seq_len + 1
    tokens, owner = stream[lo:hi], doc_of[lo:hi]
    _, segment = np.unique(owner, return_inverse=True)
    segment = segment + 1
    first_index = {s: int(np.flatnonzero(segment == s)[0]) for s in set(segment.tolist())}
    positions = np.array([i - first_index[s] for i, s in enumerate(segment.tolist())])
    return {"inputs": tokens[:-1], "targets": tokens[1:], "segment_ids": segment[:-1], "positions": positions[:-1],
            "loss_mask": (owner[1:] == owner[:-1]).astype(np.float32)}


@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_rows_match_a_brute_force_reference(tmp_path, seq_len):
    prefixes, docs = _files(tmp_path, np.random.default_rng(seq_len))
    source = PackedSource("s", prefixes, seq_len)
    total = sum(len(d) for d in docs)
    assert source.num_tokens == total and source.num_windows == (total - 1) // seq_len
    windows = list(range(source.num_windows))
    rows = source.rows(windows)
    for q in windows:
        want = _reference_row(docs, seq_len, q)
        for name, value in want.items():
            np.testing.assert_array_equal(rows[name][q], value, err_msg=f"{name} of window {q}")


def test_windows_tile_the_stream_sharing_one_token(tmp_path):
    prefixes, docs = _files(tmp_path, np.random.default_rng(0), num_files=2)
    source = PackedSource("s", prefixes, 16)
    rows = source.rows(range(source.num_windows))
    stream = np.concatenate(docs)
    covered = np.concatenate([rows["inputs"].reshape(-1), rows["targets"][-1, -1:]])
    np.testing.assert_array_equal(covered, stream[:len(covered)])
    assert len(stream) - len(covered) < 16  # only the tail shorter than a row is left out
    np.testing.assert_array_equal(rows["targets"][:-1, -1], rows["inputs"][1:, 0])


def test_loss_mask_is_zero_exactly_across_document_ends(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "d"), [[10, 11, 1], [20, 21, 22, 1], [30, 1]], np.uint16)
    row = PackedSource("s", prefix, 8).rows([0])
    assert row["inputs"][0].tolist() == [10, 11, 1, 20, 21, 22, 1, 30]
    assert row["targets"][0].tolist() == [11, 1, 20, 21, 22, 1, 30, 1]
    assert row["loss_mask"][0].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
    assert row["segment_ids"][0].tolist() == [1, 1, 1, 2, 2, 2, 2, 3]
    assert row["positions"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_too_small_or_float_sources_are_refused(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "f"), [[1.0, 2.0]], np.float32)
    with pytest.raises(DataError, match="not token ids"):
        PackedSource("floats", prefix, 4)
    small = PackedSource("small", write_indexed_dataset(str(tmp_path / "s"), [[1, 2]], np.uint16), 4)
    assert small.num_windows == 0
    with pytest.raises(IndexError):
        small.window(0)

"""Megatron indexed dataset: byte layout, round trips, and refusal of corrupt files."""

import os
import struct

import numpy as np
import pytest

from zaya_jax.data import DataError, IndexedDataset, IndexedDatasetWriter, write_indexed_dataset
from zaya_jax.data.indexed import DTYPE_CODES, token_dtype_for_vocab


def reference_idx(code: int, lengths, itemsize: int, documents, modes=None) -> bytes:
    """The .idx bytes assembled field by field from the format's definition, independently of the writer."""
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in documents)
    if modes is not None:
        out += b"".join(struct.pack("<b", m) for m in modes)
    return out


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_writer_output_is_byte_for_byte_the_format(tmp_path):
    prefix = str(tmp_path / "ds")
    docs = [[5, 6, 7], [65535], [], [1, 2]]
    write_indexed_dataset(prefix, docs, np.uint16)
    assert read(prefix + ".idx") == reference_idx(8, [3, 1, 0, 2], 2, [0, 1, 2, 3, 4])
    assert read(prefix + ".bin") == b"".join(struct.pack("<H", t) for d in docs for t in d)
    assert len(read(prefix + ".idx")) == 34 + 4 * 4 + 8 * 4 + 8 * 5


def test_multi_sequence_documents_and_modes_byte_for_byte(tmp_path):
    prefix = str(tmp_path / "mm")
    with IndexedDatasetWriter(prefix, np.int32, multimodal=True) as w:
        w.add_sequence([1, 2], mode=3)
        w.add_sequence([3])
        w.end_document()
        w.add_document([4, 5, 6], mode=1)
    assert read(prefix + ".idx") == reference_idx(4, [2, 1, 3], 4, [0, 2, 3], modes=[3, 0, 1])
    ds = IndexedDataset(prefix)
    assert ds.sequence_modes.tolist() == [3, 0, 1]
    assert ds.num_documents == 2 and ds.document_indices.tolist() == [0, 2, 3]


def test_reads_a_hand_assembled_file(tmp_path):
    prefix = str(tmp_path / "hand")
    tokens = [[10, 11, 12, 13], [20], [30, 31]]
    with open(prefix + ".idx", "wb") as f:
        f.write(reference_idx(4, [4, 1, 2], 4, [0, 2, 3]))
    with open(prefix + ".bin", "wb") as f:
        f.write(np.asarray(sum(tokens, []), np.int32).tobytes())
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_tokens == 7 and ds.sequence_modes is None
    assert [ds[i].tolist() for i in range(3)] == tokens
    assert ds.get(0, offset=1, length=2).tolist() == [11, 12]
    assert ds.tokens(3, 6).tolist() == [13, 20, 30]
    with pytest.raises(IndexError):
        ds.get(1, offset=0, length=2)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype_code(tmp_path, code):
    dtype = DTYPE_CODES[code]
    prefix = str(tmp_path / f"d{code}")
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (0, 1, 17, 3)]
    write_indexed_dataset(prefix, docs, dtype)
    assert read(prefix + ".idx")[17] == code
    ds = IndexedDataset(prefix, expected_dtype=dtype)
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in docs]


def test_empty_dataset_round_trips(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "empty"), [], np.uint16)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.num_documents == 0


def test_token_dtype_follows_megatrons_rule():
    assert token_dtype_for_vocab(512) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(262272) == np.int32


def test_writer_refuses_ids_outside_the_dtype(tmp_path):
    with pytest.raises(DataError, match="outside uint16"):
        write_indexed_dataset(str(tmp_path / "big"), [[1, 70000]], np.uint16)
    assert not os.path.exists(tmp_path / "big.idx") and not os.listdir(tmp_path)


def _good(tmp_path, dtype=np.uint16):
    prefix = str(tmp_path / "good")
    write_indexed_dataset(prefix, [[1, 2, 3], [4, 5], [6]], dtype)
    return prefix


def _patch(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage, message", [
    (lambda p: _patch(p + ".idx", 0, b"XXIDIDX"), "magic"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), "version 2"),
    (lambda p: _patch(p + ".idx", 17, b"\x0c"), "unknown dtype code 12"),
    (lambda p: _truncate(p + ".idx", 20), "truncated: 20 bytes, the header"),
    (lambda p: _truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), "truncated"),
    (lambda p: _patch(p + ".idx", 18, struct.pack("<Q", 4)), "truncated"),
    (lambda p: open(p + ".idx", "ab").write(b"\x00" * 5), "5 bytes more"),
    (lambda p: _truncate(p + ".bin", 7), "truncated: 7 bytes"),
    (lambda p: open(p + ".bin", "ab").write(b"\x00\x00"), "longer than its index"),
    (lambda p: _patch(p + ".idx", 34 + 12 + 8, struct.pack("<q", 4)), "sequence pointer 1"),
    (lambda p: _patch(p + ".idx", 34 + 4, struct.pack("<i", -1)), "negative sequence length"),
    (lambda p: _patch(p + ".idx", 34 + 12 + 24 + 24, struct.pack("<q", 2)), "document index"),
    (lambda p: os.remove(p + ".bin"), "missing"),
])
def test_corrupt_files_are_refused_with_the_file_named(tmp_path, damage, message):
    prefix = _good(tmp_path)
    damage(prefix)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(prefix)
    assert str(tmp_path / "good") in str(info.value)


def test_dtype_mismatch_is_named(tmp_path):
    prefix = _good(tmp_path)
    with pytest.raises(DataError, match="tokens are uint16 .* int32 was expected"):
        IndexedDataset(prefix, expected_dtype=np.int32)


def test_bin_written_with_another_dtype_gets_a_hint(tmp_path):
    prefix = _good(tmp_path)
    with open(prefix + ".bin", "wb") as f:  # the same 6 tokens as int32
        f.write(np.arange(6, dtype=np.int32).tobytes())
    with pytest.raises(DataError, match="may differ"):
        IndexedDataset(prefix)


def test_writer_leaves_nothing_behind_on_error(tmp_path):
    prefix = str(tmp_path / "partial")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []

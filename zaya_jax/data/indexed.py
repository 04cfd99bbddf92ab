"""Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx): an mmap reader that checks every file it
opens, and a writer whose output is byte-for-byte what Megatron-LM's own builder writes.

Layout of PREFIX.idx, all integers little-endian (learned from Megatron-LM
`megatron/core/datasets/indexed_dataset.py`):

    offset   bytes   type   field
    0        9              magic b"MMIDIDX\\x00\\x00"
    9        8       u64    version, always 1
    17       1       u8     dtype code of the tokens in PREFIX.bin (see DTYPE_CODES)
    18       8       u64    S: number of sequences
    26       8       u64    D: number of document-index entries (documents + 1)
    34       4*S     i32    sequence lengths, in tokens
    ..       8*S     i64    sequence pointers: byte offset of each sequence in PREFIX.bin
    ..       8*D     i64    document index: the sequence number at which each document starts, 0 first, S last
    ..       1*S     i8     sequence modes; only in multimodal datasets (the file is then exactly S bytes longer)

PREFIX.bin holds the tokens of all sequences back to back in the dtype of the code, nothing else.
The pipeline treats each sequence as one document, as Megatron's GPT dataset does; the document index is
kept so files round-trip unchanged.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np

from zaya_jax.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D
HEADER_BYTES = _HEADER.size  # 34
_CHECK_CHUNK = 1 << 20  # sequences per step of the pointer check

# Megatron's codes 1..8. Code 9 (uint32) is an extension some third-party writers use; stock Megatron cannot
# read it, so the writer only produces it when asked by name (Megatron's own choice above 65500 ids is int32).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
    9: np.dtype(np.uint32),
}
_CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    """True when both PREFIX.bin and PREFIX.idx are present."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 below 65500 ids, int32 otherwise (4 bytes per token, e.g. ZAYA1's 262272)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype) -> int:
    """The format's numeric code of a numpy dtype; DataError for dtypes the format cannot hold."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        known = sorted(map(str, _CODE_OF_DTYPE))
        raise DataError(f"dtype {dt} has no code in the indexed-dataset format (known: {known})")
    return _CODE_OF_DTYPE[dt]


class IndexedDataset:
    """A read-only, memory-mapped Megatron indexed dataset.

    Opening checks the whole index against the format and against the size of PREFIX.bin, so a truncated,
    corrupt or mismatched pair fails here with a DataError naming the file, never later as garbage tokens.

    Args:
        prefix: path without the .bin/.idx suffix.
        expected_dtype: if given, the token dtype the caller needs; a file holding another dtype is refused.

    Attributes (numpy views into the mmapped index, read-only):
        dtype, sequence_lengths (int32[S]), sequence_pointers (int64[S], bytes), document_indices (int64[D]),
        sequence_modes (int8[S] or None), num_tokens.
    """

    def __init__(self, prefix: str, expected_dtype=None):
        self.prefix = prefix
        self.idx_path, self.bin_path = idx_path(prefix), bin_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise DataError(f"{path}: missing (an indexed dataset is PREFIX.bin plus PREFIX.idx)")
        self._read_index()
        if expected_dtype is not None and np.dtype(expected_dtype) != self.dtype:
            raise DataError(f"{self.idx_path}: tokens are {self.dtype} (code {dtype_code(self.dtype)}) but "
                            f"{np.dtype(expected_dtype)} was expected")
        self._map_tokens()

    # ---- reading ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sequence `i` (a view into the mmapped .bin)."""
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `i`; IndexError outside the sequence."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} out of range (have {n})")
        i %= n
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {i} of {size}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Flat token range [start, stop) of the whole .bin (sequences are contiguous)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.prefix}: token range [{start}, {stop}) outside [0, {self.num_tokens})")
        return self._tokens[start:stop]

    # ---- checks ---------------------------------------------------------------------------------------------------
    def _fail(self, problem: str, path: str | None = None):
        raise DataError(f"{path or self.idx_path}: {problem}")

    def _read_index(self):
        size = os.path.getsize(self.idx_path)
        if size < HEADER_BYTES:
            self._fail(f"truncated: {size} bytes, the header alone is {HEADER_BYTES}")
        with open(self.idx_path, "rb") as f:
            magic, version, code, s, d = _HEADER.unpack(f.read(HEADER_BYTES))
        if magic != MAGIC:
            self._fail(f"not a Megatron indexed-dataset index: magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            self._fail(f"unsupported version {version} (only version {VERSION} exists)")
        if code not in DTYPE_CODES:
            self._fail(f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = DTYPE_CODES[code]
        base = HEADER_BYTES + 12 * s + 8 * d
        if size == base:
            has_modes = False
        elif size == base + s:
            has_modes = True
        elif size < base:
            self._fail(f"truncated: {size} bytes, but its header promises {s} sequences and {d} document-index "
                       f"entries ({base} bytes)")
        else:
            self._fail(f"{size - base} bytes more than its header's {s} sequences and {d} document-index entries "
                       f"account for ({base} bytes)")
        raw = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = raw[HEADER_BYTES:HEADER_BYTES + 4 * s].view("<i4")
        at = HEADER_BYTES + 4 * s
        self.sequence_pointers = raw[at:at + 8 * s].view("<i8")
        at += 8 * s
        self.document_indices = raw[at:at + 8 * d].view("<i8")
        self.sequence_modes = raw[base:base + s].view(np.int8) if has_modes else None
        self._check_index(s, d)

    def _check_index(self, s: int, d: int):
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if s and lengths.min() < 0:
            self._fail(f"negative sequence length at sequence {int(np.argmin(lengths))}")
        end = 0  # bytes so far; checked in chunks so a huge index never needs a full-size temporary
        for lo in range(0, s, _CHECK_CHUNK):
            chunk = lengths[lo:lo + _CHECK_CHUNK].astype(np.int64) * self.dtype.itemsize
            expected = end + np.concatenate([[0], np.cumsum(chunk[:-1])])
            bad = np.flatnonzero(pointers[lo:lo + len(chunk)] != expected)
            if bad.size:
                i = lo + int(bad[0])
                self._fail(f"sequence pointer {i} is {int(pointers[i])}, but the lengths before it place it at "
                           f"byte {int(expected[bad[0]])} (sequences must lie back to back in the .bin)")
            end += int(chunk.sum())
        if d < 1 or docs[0] != 0 or docs[-1] != s:
            first, last = (int(docs[0]), int(docs[-1])) if d else (None, None)
            self._fail(f"document index must run from 0 to the sequence count {s}; it has {d} entries from "
                       f"{first} to {last}")
        if np.any(np.diff(docs) < 0):
            self._fail("document index decreases")
        self.num_tokens = int(lengths.sum(dtype=np.int64))

    def _map_tokens(self):
        want = self.num_tokens * self.dtype.itemsize
        have = os.path.getsize(self.bin_path)
        if have != want:
            hint = ""
            for other in DTYPE_CODES.values():
                if other != self.dtype and have == self.num_tokens * other.itemsize and have:
                    hint = f"; its size fits {self.num_tokens} {other} tokens, so the .bin's dtype may differ"
                    break
            kind = "truncated" if have < want else "longer than its index describes"
            self._fail(f"{kind}: {have} bytes, but {self.idx_path} describes {self.num_tokens} {self.dtype} tokens "
                       f"({want} bytes){hint}", self.bin_path)
        if want:
            self._tokens = np.memmap(self.bin_path, mode="r", dtype=self.dtype)
        else:  # mmap cannot map an empty file
            self._tokens = np.zeros(0, self.dtype)


class IndexedDatasetWriter:
    """Writes PREFIX.bin / PREFIX.idx exactly as Megatron's builder does.

    Use as a context manager; the files appear under their final names only when the block finishes without
    an exception (they are written to temporary names first, so a crash never leaves a half-written dataset).

        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document(token_ids)            # one sequence, one document
            w.add_sequence(a); w.add_sequence(b); w.end_document()   # a document of two sequences

    `multimodal=True` writes the optional per-sequence mode bytes (`mode=` of add_sequence, default 0).
    """

    def __init__(self, prefix: str, dtype, multimodal: bool = False):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.multimodal = multimodal
        self._lengths: list[int] = []
        self._modes: list[int] = []
        self._documents: list[int] = [0]
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        self._tmp = f".tmp-{os.getpid()}-{id(self)}"
        self._bin = open(bin_path(prefix) + self._tmp, "wb")

    def add_sequence(self, tokens, mode: int | None = None):
        array = self._as_tokens(tokens)
        if len(array) >= 2**31:
            raise DataError(f"{self.prefix}: a sequence of {len(array)} tokens does not fit the int32 length field")
        self._bin.write(array.tobytes(order="C"))
        self._lengths.append(len(array))
        if self.multimodal:
            self._modes.append(0 if mode is None else int(mode))
        elif mode is not None:
            raise DataError(f"{self.prefix}: a mode was given but the writer is not multimodal")

    def end_document(self):
        self._documents.append(len(self._lengths))

    def add_document(self, tokens, mode: int | None = None):
        self.add_sequence(tokens, mode)
        self.end_document()

    def finalize(self) -> str:
        """Writes the index and moves both files into place; returns the prefix."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        documents = np.asarray(self._documents, dtype=np.int64)
        with open(idx_path(self.prefix) + self._tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
            if self.multimodal:
                f.write(np.asarray(self._modes, dtype=np.int8).tobytes())
        # .bin first: a reader that sees the new .idx then also sees the matching .bin
        os.replace(bin_path(self.prefix) + self._tmp, bin_path(self.prefix))
        os.replace(idx_path(self.prefix) + self._tmp, idx_path(self.prefix))
        return self.prefix

    def abort(self):
        self._bin.close()
        for path in (bin_path(self.prefix) + self._tmp, idx_path(self.prefix) + self._tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def _as_tokens(self, tokens) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise DataError(f"{self.prefix}: a sequence must be 1-D, got shape {array.shape}")
        if array.size and np.issubdtype(self.dtype, np.integer):
            if not np.issubdtype(array.dtype, np.integer):
                raise DataError(f"{self.prefix}: token ids must be integers, got {array.dtype}")
            info = np.iinfo(self.dtype)
            lo, hi = int(array.min()), int(array.max())
            if lo < info.min or hi > info.max:
                raise DataError(f"{self.prefix}: token ids span [{lo}, {hi}], outside {self.dtype}'s "
                                f"[{info.min}, {info.max}]; write with a wider dtype")
        return array.astype(self.dtype, copy=False)


def write_indexed_dataset(prefix: str, documents: Iterable, dtype) -> str:
    """Writes each item of `documents` (a 1-D sequence of token ids) as one sequence and one document."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for tokens in documents:
            writer.add_document(tokens)
    return prefix

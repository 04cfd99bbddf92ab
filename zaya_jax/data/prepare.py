"""Tokenizing raw text into indexed datasets: the logic behind `python -m launch.prepare_data`.

Inputs, one document each:
    text     (.txt, anything unknown)  the whole file, or each non-empty line with split_lines=True
    JSONL    (.jsonl, .json)           the `text_key` field of each line
    parquet  (.parquet)                the `text_key` column of each row (needs pyarrow)
Files ending in .gz are decompressed on the fly. Empty documents are skipped, as Megatron's tool does.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from zaya_jax.data.errors import DataError
from zaya_jax.data.indexed import IndexedDatasetWriter, token_dtype_for_vocab
from zaya_jax.data.tokenizer import Tokenizer

FORMATS = ("auto", "text", "jsonl", "parquet")


def detect_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def check_input(path: str) -> None:
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory: name its files")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such input file")


def iter_documents(paths: Sequence[str], fmt: str = "auto", *, text_key: str = "text",
                   split_lines: bool = False, replaced: dict | None = None) -> Iterator[str]:
    """The documents of `paths`, in order (files in the order given). Invalid UTF-8 in text and JSONL inputs is
    replaced by U+FFFD; `replaced`, if given, receives {path: bytes replaced} for every file that had any."""
    if fmt not in FORMATS:
        raise DataError(f"unknown input format {fmt!r} (choose from {FORMATS})")
    for path in paths:
        check_input(path)
        kind = detect_format(path) if fmt == "auto" else fmt
        before = _REPLACED.count
        if kind == "parquet":
            yield from _parquet_documents(path, text_key)
        elif kind == "jsonl":
            yield from _jsonl_documents(path, text_key)
        elif split_lines:
            with _open_text(path) as f:
                yield from (line.rstrip("\n") for line in f if line.strip())
        else:
            with _open_text(path) as f:
                yield f.read()
        if replaced is not None and _REPLACED.count > before:
            replaced[path] = replaced.get(path, 0) + _REPLACED.count - before


class _ReplacedBytes(threading.local):
    count = 0


_REPLACED = _ReplacedBytes()  # bytes of invalid UTF-8 decoded as U+FFFD so far, in this thread


def _replace_counted(e: UnicodeDecodeError):
    _REPLACED.count += e.end - e.start
    return "\ufffd", e.end


codecs.register_error("zaya_replace_counted", _replace_counted)


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="zaya_replace_counted")
    return open(path, encoding="utf-8", errors="zaya_replace_counted")


def check_not_inputs(inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """Refuses output files that are one of the inputs (the finished dataset would replace its own source)."""
    real = {os.path.realpath(p): p for p in inputs}
    for out in outputs:
        if os.path.realpath(out) in real:
            raise DataError(f"output {out} is the input {real[os.path.realpath(out)]}: choose another "
                            "--output-prefix")


def _jsonl_documents(path: str, text_key: str) -> Iterator[str]:
    with _open_text(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_number}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or text_key not in record:
                raise DataError(f"{path}:{line_number}: no {text_key!r} field")
            text = record[text_key]
            if not isinstance(text, str):  # str() would turn null into the document "None", 5 into "5"
                raise DataError(f"{path}:{line_number}: the {text_key!r} field is {_json_type(text)}, not a string")
            yield text


def _json_type(value) -> str:
    """The JSON name of a decoded value's type, as the user wrote it in the file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _parquet_documents(path: str, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow, which is not installed "
                        f"(pip install pyarrow, or convert the file to JSONL)") from e
    table = pq.ParquetFile(path)
    if text_key not in table.schema_arrow.names:
        raise DataError(f"{path}: no column {text_key!r} (columns: {table.schema_arrow.names})")
    for batch in table.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise DataError(f"{path}: column {text_key!r} holds {type(text).__name__} values, not text")
            if text is not None:
                yield text


@dataclasses.dataclass
class PrepareStats:
    documents: int = 0
    tokens: int = 0
    valid_documents: int = 0
    valid_tokens: int = 0
    seconds: float = 0.0


def tokenize_to_indexed(documents: Iterable[str], tokenizer: Tokenizer, prefix: str, *, dtype=None,
                        append_eos: bool = True, valid_prefix: str | None = None, holdout_every: int = 0,
                        batch_size: int = 256) -> PrepareStats:
    """Tokenizes `documents` into PREFIX.bin/.idx, one sequence per document.

    Args:
        dtype: token dtype; default uint16 below 65500 ids, int32 above (Megatron's rule).
        append_eos: end every document with the tokenizer's eos id (Megatron's --append-eod), so packed
            sequences carry the boundary in the tokens as well as in the segment ids.
        valid_prefix, holdout_every: with both set, every `holdout_every`-th document (the last of each group)
            goes to VALID_PREFIX.bin/.idx instead, a held-out split that shares no document with training.
    """
    if append_eos and tokenizer.eos_id is None:
        raise DataError("append_eos needs a tokenizer with an eos token (name it, or pass append_eos=False)")
    if (valid_prefix is None) != (holdout_every <= 0):
        raise DataError("a held-out split needs both valid_prefix and holdout_every > 0")
    dtype = token_dtype_for_vocab(tokenizer.vocab_size) if dtype is None else np.dtype(dtype)
    stats, start = PrepareStats(), time.perf_counter()
    eos = np.asarray([tokenizer.eos_id] if append_eos else [], dtype=np.int64)
    train = IndexedDatasetWriter(prefix, dtype)
    valid = IndexedDatasetWriter(valid_prefix, dtype) if valid_prefix else None
    try:
        index = 0
        for texts in _batches((d for d in documents if d), batch_size):
            for ids in tokenizer.encode_batch(texts):
                tokens = np.concatenate([ids, eos])
                if valid is not None and index % holdout_every == holdout_every - 1:
                    valid.add_document(tokens)
                    stats.valid_documents += 1
                    stats.valid_tokens += len(tokens)
                else:
                    train.add_document(tokens)
                    stats.documents += 1
                    stats.tokens += len(tokens)
                index += 1
        if stats.documents == 0:  # an empty dataset would only fail later, in training's first batch
            raise DataError("the inputs hold no document to train on" + (
                f" ({stats.valid_documents} went to the held-out split)" if stats.valid_documents else
                " (every one is empty)") + "; nothing written")
    except BaseException:
        train.abort()
        if valid is not None:
            valid.abort()
        raise
    train.finalize()
    if valid is not None:
        valid.finalize()
    stats.seconds = time.perf_counter() - start
    return stats


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

"""Tokenizing text / JSONL / parquet into indexed datasets, through the library and the CLI."""

import gzip
import importlib.util
import json

import numpy as np
import pytest

from launch.prepare_data import main as prepare_main
from zaya_jax.data import ByteTokenizer, DataError, IndexedDataset, iter_documents, tokenize_to_indexed

TOK = ByteTokenizer()


def decoded(prefix):
    ds = IndexedDataset(prefix)
    return [TOK.decode(ds[i]) for i in range(len(ds))], ds


def test_jsonl_with_eos_and_holdout(tmp_path):
    src = tmp_path / "in.jsonl"
    texts = [f"document number {i}" for i in range(7)]
    src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n\n")
    stats = tokenize_to_indexed(iter_documents([str(src)]), TOK, str(tmp_path / "out"),
                                valid_prefix=str(tmp_path / "val"), holdout_every=3)
    train, ds = decoded(str(tmp_path / "out"))
    valid, _ = decoded(str(tmp_path / "val"))
    assert train == [texts[i] for i in (0, 1, 3, 4, 6)] and valid == [texts[2], texts[5]]
    assert ds.dtype == np.uint16 and all(ds[i][-1] == TOK.eos_id for i in range(len(ds)))
    assert (stats.documents, stats.valid_documents) == (5, 2)
    assert stats.tokens == sum(len(t) + 1 for t in train)


def test_text_files_whole_or_by_line_and_gzip(tmp_path):
    (tmp_path / "a.txt").write_text("first\n\nsecond line\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("zipped")
    paths = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt.gz")]
    assert list(iter_documents(paths)) == ["first\n\nsecond line\n", "zipped"]
    assert list(iter_documents(paths, split_lines=True)) == ["first", "second line", "zipped"]


def test_bad_inputs_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: no 'text' field"):
        list(iter_documents([str(bad)]))
    with pytest.raises(DataError, match="no such input"):
        list(iter_documents([str(tmp_path / "missing.txt")]))
    for value, kind in (("null", "null"), ("5", "a number"), ("true", "a boolean"), ('["a"]', "an array"),
                        ('{"a": 1}', "an object")):
        bad.write_text(f'{{"text": "ok"}}\n{{"text": {value}}}\n')
        with pytest.raises(DataError, match=f"bad.jsonl:2: the 'text' field is {kind}, not a string"):
            list(iter_documents([str(bad)]))


def written(tmp_path) -> dict:
    """The dataset files under tmp_path/out* (the training and held-out splits) and their bytes."""
    return {p.name: p.read_bytes() for p in tmp_path.glob("out*")}


def prepared_once(tmp_path, capsys, name: str, text: str):
    """A first dataset prepared from tmp_path/name holding text: (that source, the output prefix, its files)."""
    src = tmp_path / name
    src.write_text(text)
    out = str(tmp_path / "out")
    assert prepare_main([str(src), "--output-prefix", out]) == 0
    capsys.readouterr()
    return src, out, written(tmp_path)


def test_cli_refuses_a_non_string_text_field_and_keeps_the_old_output(tmp_path, capsys):
    src, out, before = prepared_once(tmp_path, capsys, "docs.jsonl", '{"text": "hello"}\n')
    for value, kind in (("null", "null"), ("5", "a number")):  # were the documents "None" and "5"
        src.write_text(f'{{"text": "hello"}}\n{{"text": {value}}}\n')
        assert prepare_main([str(src), "--output-prefix", out, "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert err == f"prepare_data: {src}:2: the 'text' field is {kind}, not a string\n"
        assert written(tmp_path) == before  # the last dataset stays


def test_cli_refuses_inputs_without_a_document_and_keeps_the_old_output(tmp_path, capsys):
    src, out, before = prepared_once(tmp_path, capsys, "docs.txt", "hello")
    src.write_text("")
    assert prepare_main([str(src), "--output-prefix", out, "--overwrite"]) == 1
    assert capsys.readouterr().err == "prepare_data: the inputs hold no document to train on (every one is empty); " \
                                      "nothing written\n"
    src.write_text("hello")  # one document, and it is held out
    assert prepare_main([str(src), "--output-prefix", out, "--holdout-every", "1", "--overwrite"]) == 1
    assert "(1 went to the held-out split)" in capsys.readouterr().err
    assert written(tmp_path) == before  # the last dataset stays


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_so(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="needs pyarrow"):
        list(iter_documents([str(path)]))


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_parquet_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "two"]}), tmp_path / "x.parquet")
    assert list(iter_documents([str(tmp_path / "x.parquet")])) == ["one", "two"]


def test_cli_writes_dataset_and_reports_errors(tmp_path, capsys):
    src = tmp_path / "doc.txt"
    src.write_text("hello\nworld\n")
    out = str(tmp_path / "cli")
    assert prepare_main([str(src), "--output-prefix", out, "--split-lines", "--dtype", "int32"]) == 0
    texts, ds = decoded(out)
    assert texts == ["hello", "world"] and ds.dtype == np.int32
    assert "2 documents" in capsys.readouterr().out
    assert prepare_main([str(tmp_path / "nope.txt"), "--output-prefix", out]) == 1
    assert "no such input file" in capsys.readouterr().err
    assert prepare_main([str(tmp_path), "--output-prefix", out]) == 1
    assert f"{tmp_path} is a directory: name its files" in capsys.readouterr().err
    src.write_text("other\n")  # the same output again: refused, the dataset kept, unless --overwrite
    assert prepare_main([str(src), "--output-prefix", out]) == 1
    assert f"{out}.bin, {out}.idx already exist: pass --overwrite to replace them" in capsys.readouterr().err
    assert decoded(out)[0] == ["hello", "world"]
    assert prepare_main([str(src), "--output-prefix", out, "--overwrite"]) == 0
    assert decoded(out)[0] == ["other\n"]


def test_cli_refuses_to_overwrite_its_input_and_counts_invalid_utf8(tmp_path, capsys):
    src = tmp_path / "doc.bin"  # an input named like the output's .bin
    src.write_bytes(b"good\xff\xfe text\n")
    assert prepare_main([str(src), "--output-prefix", str(tmp_path / "doc")]) == 1
    assert "is the input" in capsys.readouterr().err and src.read_bytes() == b"good\xff\xfe text\n"
    gz = tmp_path / "bad.txt.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b"caf\xe9 \x80ok\n")
    out = str(tmp_path / "out")
    assert prepare_main([str(src), str(gz), "--output-prefix", out]) == 0
    err = capsys.readouterr().err
    assert f"{src}: replaced 2 bytes of invalid UTF-8" in err and f"{gz}: replaced 2 bytes" in err
    assert decoded(out)[0] == ["good\ufffd\ufffd text\n", "caf\ufffd \ufffdok\n"]

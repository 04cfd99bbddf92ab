"""The built-in corpus: Python's documentation topics ('web') and standard-library sources ('code')."""

import json
import os

from pydoc_data.topics import topics

from zaya_jax.data import ByteTokenizer, IndexedDataset, builtin_corpus
from zaya_jax.data.corpus import HOLDOUT_EVERY, code_files

TOK = ByteTokenizer()


def _bytes(prefix):
    with open(prefix + ".idx", "rb") as a, open(prefix + ".bin", "rb") as b:
        return a.read() + b.read()


def test_builds_once_deterministically_and_holds_the_sources(tmp_path):
    corpus = builtin_corpus(TOK, str(tmp_path / "a"))
    web = IndexedDataset(corpus.train["web"])
    first_topic = topics[sorted(topics)[0]]
    assert TOK.decode(web[0]) == first_topic  # eos dropped by decode
    assert web[0][-1] == TOK.eos_id

    names = sorted(topics)
    n_valid = len(names) // HOLDOUT_EVERY
    assert len(web) == len(names) - n_valid
    assert len(IndexedDataset(corpus.valid["web"])) == n_valid
    code, code_valid = IndexedDataset(corpus.train["code"]), IndexedDataset(corpus.valid["code"])
    non_empty = [p for p in code_files() if p.stat().st_size]  # empty files (e.g. __init__.py) are skipped
    assert len(code) + len(code_valid) == len(non_empty) > 100
    assert code.num_tokens > 1_000_000 and not any("/test/" in p.as_posix() for p in code_files())
    manifest = json.load(open(os.path.join(corpus.directory, "manifest.json")))
    assert manifest["sources"]["code"]["tokens"] == code.num_tokens

    # a second call reuses the cache; a build elsewhere gives identical bytes
    stamp = os.stat(corpus.train["code"] + ".bin").st_mtime_ns
    assert builtin_corpus(TOK, str(tmp_path / "a")) == corpus
    assert os.stat(corpus.train["code"] + ".bin").st_mtime_ns == stamp
    other = builtin_corpus(TOK, str(tmp_path / "b"))
    for split in ("train", "valid"):
        for source in ("web", "code"):
            assert _bytes(getattr(other, split)[source]) == _bytes(getattr(corpus, split)[source])

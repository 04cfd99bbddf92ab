"""The built-in corpus for the default run: text that ships with Python itself, so nothing is downloaded.

Two sources, each split into train and a held-out valid part (every 10th document):
    web   the standard library's documentation topics (`pydoc_data.topics.topics`, ~0.5 MB of prose)
    code  the standard library's own .py sources, tests excluded (~10 MB)

Documents are taken in sorted order, so the corpus is a pure function of the Python version and the
tokenizer; it is tokenized into indexed datasets under a cache directory on first use and reused after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sysconfig
from collections.abc import Iterator

from zaya_jax.data.indexed import exists
from zaya_jax.data.prepare import tokenize_to_indexed
from zaya_jax.data.tokenizer import Tokenizer

CORPUS_VERSION = 1
HOLDOUT_EVERY = 10
SOURCES = ("web", "code")
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def default_cache_dir() -> str:
    """$ZAYA_DATA_CACHE, else ~/.cache/zaya_jax/corpus."""
    return os.environ.get("ZAYA_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zaya_jax", "corpus")


def web_documents() -> Iterator[str]:
    """The pydoc topics, one document per topic, in sorted topic order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def code_files() -> list[pathlib.Path]:
    """The standard library's .py files (tests and site-packages excluded), sorted by relative path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def code_documents() -> Iterator[str]:
    for path in code_files():
        yield path.read_bytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class BuiltinCorpus:
    """Paths of the tokenized corpus: `train[source]` and `valid[source]` are indexed-dataset prefixes."""

    directory: str
    train: dict[str, str]
    valid: dict[str, str]


def builtin_corpus(tokenizer: Tokenizer, cache_dir: str | None = None) -> BuiltinCorpus:
    """The built-in corpus tokenized with `tokenizer`, built on first use (a few seconds with the byte tokenizer).

    Safe when several processes call it at once: each builds in a private folder and the first to finish
    publishes it with an atomic rename.
    """
    cache_dir = cache_dir or default_cache_dir()
    key = {"version": CORPUS_VERSION, "python": platform.python_version(), "tokenizer": tokenizer.fingerprint,
           "holdout_every": HOLDOUT_EVERY}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    directory = os.path.join(cache_dir, f"builtin-{digest}")
    corpus = BuiltinCorpus(directory, {s: os.path.join(directory, f"{s}_train") for s in SOURCES},
                           {s: os.path.join(directory, f"{s}_valid") for s in SOURCES})
    if not all(exists(p) for p in (*corpus.train.values(), *corpus.valid.values())):
        _build(corpus, tokenizer, key)
    return corpus


def _build(corpus: BuiltinCorpus, tokenizer: Tokenizer, key: dict):
    staging = f"{corpus.directory}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    manifest = {"key": key, "sources": {}}
    for source, documents in (("web", web_documents()), ("code", code_documents())):
        stats = tokenize_to_indexed(documents, tokenizer, os.path.join(staging, f"{source}_train"),
                                    valid_prefix=os.path.join(staging, f"{source}_valid"),
                                    holdout_every=HOLDOUT_EVERY)
        manifest["sources"][source] = dataclasses.asdict(stats)
    with open(os.path.join(staging, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    try:
        os.rename(staging, corpus.directory)
    except OSError:  # another process published first (or a stale partial folder is in the way)
        if all(exists(p) for p in (*corpus.train.values(), *corpus.valid.values())):
            shutil.rmtree(staging, ignore_errors=True)
        else:
            shutil.rmtree(corpus.directory, ignore_errors=True)
            os.rename(staging, corpus.directory)

"""Tokenizers behind one small interface: a built-in byte-level tokenizer and Hugging Face `tokenizer.json`.

    tok = load_tokenizer("byte")                    # or a path to tokenizer.json / a folder holding one
    ids = tok.encode("text")                         # int32 array, no special tokens added
    text = tok.decode(ids)                           # special ids are dropped
    tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id, tok.fingerprint
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from zaya_jax.data.errors import DataError


class Tokenizer(abc.ABC):
    """What the data pipeline needs of a tokenizer.

    Attributes:
        vocab_size: number of ids the tokenizer can produce (the model's vocab must be at least this).
        eos_id, bos_id, pad_id: special ids, None where the vocabulary has no such token.
        fingerprint: a short string that changes whenever the mapping text -> ids changes (names caches).
    """

    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    pad_id: int | None
    fingerprint: str

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of `text`, without special tokens."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`; special tokens are skipped."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: pad 0, eos 1, bos 2, byte b -> id 3 + b (ids 3..258, vocab_size 259).

    Needs no files, so the default run works offline; 259 ids fit the `tiny` preset's vocab of 512.
    """

    PAD, EOS, BOS, OFFSET = 0, 1, 2, 3
    vocab_size = OFFSET + 256
    pad_id, eos_id, bos_id = PAD, EOS, BOS
    fingerprint = "byte-v1"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self.OFFSET

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        data = ids[(ids >= self.OFFSET) & (ids < self.vocab_size)] - self.OFFSET
        return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# Names under which common vocabularies spell their special tokens, tried in order when not given.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file.

    Special tokens: the names given here, else those in a tokenizer_config.json beside the file, else the
    first of the common spellings (`<|endoftext|>`, `</s>`, ...) the vocabulary contains, else None.
    """

    def __init__(self, path: str, *, eos_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None):
        import tokenizers  # a core dependency; imported here so the byte tokenizer needs nothing

        if not os.path.isfile(path):
            raise DataError(f"{path}: no tokenizer.json there")
        self.path = path
        with open(path, "rb") as f:
            raw = f.read()
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own exception types
            raise DataError(f"{path}: not a readable tokenizer.json ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _tokenizer_config(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
        self.eos_id = self._special(eos_token or config.get("eos_token"), _EOS_NAMES)
        self.bos_id = self._special(bos_token or config.get("bos_token"), _BOS_NAMES)
        self.pad_id = self._special(pad_token or config.get("pad_token"), _PAD_NAMES)
        digest = hashlib.sha256(raw + repr((self.eos_id, self.bos_id, self.pad_id)).encode()).hexdigest()
        self.fingerprint = "hf-" + digest[:16]

    def _special(self, name: str | None, fallbacks: Sequence[str]) -> int | None:
        if name is not None:
            token_id = self._tok.token_to_id(name)
            if token_id is None:
                raise DataError(f"{self.path}: special token {name!r} is not in the vocabulary")
            return token_id
        for candidate in fallbacks:
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids) -> str:
        special = {self.eos_id, self.bos_id, self.pad_id}
        kept = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) not in special]
        return self._tok.decode(kept, skip_special_tokens=True)


def _tokenizer_config(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    # special tokens appear either as plain strings or as {"content": "..."} objects
    return {key: (value["content"] if isinstance(value, dict) else value)
            for key, value in config.items() if key in ("eos_token", "bos_token", "pad_token") and value}


def load_tokenizer(spec: str = "byte", **special_tokens) -> Tokenizer:
    """"byte" -> ByteTokenizer; a tokenizer.json path, or a folder holding one, -> HFTokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    if not spec:
        raise DataError("no tokenizer given: set data.tokenizer (--config.data.tokenizer=...) to 'byte', a "
                        "tokenizer.json file, or a folder holding one: the one prepare_data tokenized the data with")
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise DataError(f"{spec}: not 'byte', a tokenizer.json file, or a folder holding one")
    return HFTokenizer(path, **special_tokens)

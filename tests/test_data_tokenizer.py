"""Byte-level and tokenizer.json tokenizers behind one interface."""

import json

import numpy as np
import pytest

from zaya_jax.config import tiny
from zaya_jax.data import ByteTokenizer, DataError, HFTokenizer, load_tokenizer

TEXTS = ["", "hello world", "naïve café — 日本語 🙂", "tabs\tand\nnewlines\r\n", "\x00\x01 control"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_ids_and_vocab():
    tok = load_tokenizer("byte")
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.encode("\x00\xff".encode("latin-1").decode("latin-1")).min() >= 3
    ids = tok.encode("A")
    assert ids.tolist() == [3 + ord("A")]
    assert tok.vocab_size == 259 <= tiny().vocab_size
    all_bytes = bytes(range(256)).decode("latin-1")
    assert tok.encode(all_bytes).max() < tok.vocab_size
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id, tok.pad_id]) == "hi"


def _word_level(path, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_json(tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4}
    path = _word_level(tmp_path / "tokenizer.json", vocab)
    tok = load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 5 and tok.eos_id == 1 and tok.pad_id == 2 and tok.bos_id is None
    assert tok.encode("hello world hello").tolist() == [3, 4, 3]
    assert [a.tolist() for a in tok.encode_batch(["world", "hello"])] == [[4], [3]]
    assert tok.decode([3, 4, 1]) == "hello world"  # eos is special and dropped
    assert tok.fingerprint.startswith("hf-") and tok.fingerprint == HFTokenizer(path).fingerprint


def test_hf_special_tokens_from_config_and_by_name(tmp_path):
    vocab = {"<unk>": 0, "[END]": 1, "</s>": 2, "hi": 3}
    path = _word_level(tmp_path / "tokenizer.json", vocab)
    assert HFTokenizer(path).eos_id == 2  # the common spelling
    assert HFTokenizer(path, eos_token="[END]").eos_id == 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "[END]"}}))
    assert HFTokenizer(path).eos_id == 1
    with pytest.raises(DataError, match="not in the vocabulary"):
        HFTokenizer(path, bos_token="<s>")


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(DataError, match="not 'byte'"):
        load_tokenizer(str(tmp_path / "nothing.json"))
    with pytest.raises(DataError, match=r"no tokenizer given: set data.tokenizer"):  # a phase config's empty default
        load_tokenizer("")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a readable tokenizer.json"):
        load_tokenizer(str(bad))

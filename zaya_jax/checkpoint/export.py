"""A training run as a Hugging Face directory: config.json + safetensors (to_hf), the run's tokenizer as
tokenizer.json + tokenizer_config.json, and generation_config.json; loads with AutoModelForCausalLM and
AutoTokenizer.from_pretrained. The tokenizer comes from the run's record (DIR/run.json); the byte tokenizer is
written as an equivalent byte-level tokenizer.json (same ids: pad 0, eos 1, bos 2, byte b -> 3 + b).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# names of the byte tokenizer's special ids in its tokenizer.json (a text holding them verbatim encodes to the
# special id there, to its bytes in ByteTokenizer)
BYTE_SPECIALS = {ByteTokenizer.PAD: "<|pad|>", ByteTokenizer.EOS: "<|endoftext|>",
                 ByteTokenizer.BOS: "<|begin_of_text|>"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer and decoder."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer_json() -> str:
    """ByteTokenizer as a Hugging Face tokenizers file: a byte-level BPE without merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {name: i for i, name in BYTE_SPECIALS.items()}
    vocab.update({ch: ByteTokenizer.OFFSET + b for b, ch in _bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_SPECIALS[i], special=True) for i in sorted(BYTE_SPECIALS)])
    return tok.to_str()


def write_tokenizer(spec: str, out: Path, *, model_max_length: int) -> HFTokenizer:
    """The tokenizer `spec` ('byte' or a tokenizer.json path / folder) as HF tokenizer files in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if spec == "byte":
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        names = {"pad_token": BYTE_SPECIALS[ByteTokenizer.PAD], "eos_token": BYTE_SPECIALS[ByteTokenizer.EOS],
                 "bos_token": BYTE_SPECIALS[ByteTokenizer.BOS]}
        config = None
    else:
        src = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
        shutil.copyfile(src, out / "tokenizer.json")
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            beside = os.path.join(os.path.dirname(src), name)
            if os.path.isfile(beside):
                shutil.copyfile(beside, out / name)
        config = out / "tokenizer_config.json"
        tok = HFTokenizer(str(out / "tokenizer.json"))
        names = {f"{k}_token": tok._tok.id_to_token(i) for k, i in
                 (("pad", tok.pad_id), ("eos", tok.eos_id), ("bos", tok.bos_id)) if i is not None}
    if config is None or not config.is_file():  # what AutoTokenizer needs to build a fast tokenizer
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length, **names},
            indent=1) + "\n")
    return load_tokenizer(str(out))


# what a HF directory holds beside config.json and the weights: the tokenizer and generation settings
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def write_generation_config(out: Path, cfg, tok: HFTokenizer | None = None) -> Path:
    """generation_config.json: the tokenizer's bos / eos / pad ids, else the model config's."""
    def pick(name):
        own = getattr(tok, f"{name}_id", None) if tok is not None else None
        return own if own is not None else getattr(cfg, f"{name}_token_id")

    path = out / "generation_config.json"
    path.write_text(json.dumps({f"{name}_token_id": pick(name) for name in ("bos", "eos", "pad")}, indent=1) + "\n")
    return path


def copy_side_files(source, out: Path, cfg) -> list[str]:
    """The tokenizer and generation files of HF directory `source` copied into `out`, as export_run writes them
    for a run; generation_config.json from `cfg` where `source` has none. Returns the names copied."""
    copied = [name for name in SIDE_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copyfile(os.path.join(source, name), out / name)
    if "generation_config.json" not in copied:
        write_generation_config(out, cfg)
    return copied


def export_run(run, out, *, step: int | None = None, tokenizer: str | None = None, dtype=None,
               max_shard_bytes: int | None = None, overwrite: bool = False) -> Path:
    """Writes run `run` (its latest checkpoint, or `step`) as a Hugging Face directory `out`. Refuses, before
    loading anything, an `out` that is the run itself, a training run, or holds weights without `overwrite`."""
    import jax.numpy as jnp

    from zaya_jax.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, check_export_target, to_hf
    from zaya_jax.inference.loading import load_model
    from zaya_jax.train.run_record import default_tokenizer

    check_export_target(out, source=run, overwrite=overwrite)
    spec = tokenizer or default_tokenizer(run)
    model = load_model(run, step=step)
    out = to_hf(model, out, dtype=dtype and jnp.dtype(dtype),
                max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, overwrite=overwrite)
    tok = write_tokenizer(spec, out, model_max_length=model.cfg.max_position_embeddings)
    write_generation_config(out, model.cfg, tok)
    return out

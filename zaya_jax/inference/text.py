"""Text in, text out: tokenize prompts, generate with the cached decoder, decode the new tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.generate import generate
from zaya_jax.inference.sampling import GREEDY, Sampling


def complete(decoder: Decoder, tokenizer: Tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
             sampling: Sampling = GREEDY, key=None, stop_tokens: Sequence[int] | None = None,
             max_prompt_tokens: int | None = None, batch_rows: int | None = None) -> list[str]:
    """The decoded continuation of each prompt (stop token and padding dropped).

    stop_tokens: default the tokenizer's EOS. max_prompt_tokens: keep only a prompt's last tokens. batch_rows:
    fill the batch up to this many rows (repeating the first prompt) so every call has one compiled shape. An
    empty prompt starts from BOS (else EOS)."""
    if stop_tokens is None:
        stop_tokens = [t for t in (tokenizer.eos_id,) if t is not None]
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    ids = []
    for text in prompts:
        p = tokenizer.encode(text).tolist()
        if not p:
            if start is None:
                raise ValueError("empty prompt and the tokenizer has no BOS/EOS token to start from")
            p = [start]
        ids.append(p[-max_prompt_tokens:] if max_prompt_tokens else p)
    if batch_rows is not None and len(ids) < batch_rows:
        ids += [ids[0]] * (batch_rows - len(ids))
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else None
    gen = generate(decoder, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_tokens=stop_tokens, key=key,
                   pad_id=pad_id)
    return [tokenizer.decode(np.asarray(gen.row(i))) for i in range(len(prompts))]

"""Hugging Face generation reference. Run with the reference venv (torch + transformers), never with jax:

    .venv-ref/bin/python tests/hf_reference/generate_reference.py SPEC.json

SPEC.json = {"model_dir", "out_dir", "input_ids" [B, T] left-padded, "attention_mask" [B, T], "max_new_tokens",
"eos_token_id", "pad_token_id"}. Loads ZayaForCausalLM.from_pretrained(model_dir) (fp32, eager attention) and runs
generate() greedily with its own cache (KV + CCA conv + delayed-value states, positions from the attention mask).
Writes out_dir/reference.npz: "sequences" [B, T + new] and "logits" [new, B, V] (the logits of every step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import ZayaForCausalLM


def main(spec_path: str) -> None:
    job = json.loads(Path(spec_path).read_text())
    out = Path(job["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    model = ZayaForCausalLM.from_pretrained(job["model_dir"], attn_implementation="eager", dtype=torch.float32)
    model.eval()
    ids = torch.tensor(job["input_ids"], dtype=torch.long)
    mask = torch.tensor(job["attention_mask"], dtype=torch.long)
    with torch.no_grad():
        result = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=job["max_new_tokens"], eos_token_id=job["eos_token_id"],
                                pad_token_id=job["pad_token_id"], return_dict_in_generate=True, output_logits=True)
    np.savez(out / "reference.npz", sequences=result.sequences.numpy(),
             logits=torch.stack(result.logits).float().numpy())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    main(sys.argv[1])

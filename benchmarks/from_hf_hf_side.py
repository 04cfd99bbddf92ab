"""The Hugging Face half of benchmarks/from_hf_h200.py (PyTorch + transformers, no JAX): a random-initialised
ZayaForCausalLM from WORK/init/config.json, written by save_pretrained in bf16 (sharded safetensors) to WORK/hf, and
its logits at the last positions of WORK/ids.npy in bf16 and, upcast, in fp32 (WORK/hf_logits.npz, WORK/hf.json).

python benchmarks/from_hf_hf_side.py WORK DEVICE LAST_POSITIONS"""

import json
import os
import sys
import time

import numpy as np
import torch
import transformers


def main():
    work, device, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(os.path.join(work, "init"))
    start = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    report = {"init_s": round(time.perf_counter() - start, 1),
              "parameters": int(sum(p.numel() for p in model.parameters()))}
    model = model.to(torch.bfloat16)
    start = time.perf_counter()
    model.save_pretrained(os.path.join(work, "hf"), max_shard_size="5GB")
    report["save_s"] = round(time.perf_counter() - start, 1)
    ids = torch.as_tensor(np.load(os.path.join(work, "ids.npy")), device=device)
    logits = {}
    with torch.no_grad():
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            model = model.to(dtype)  # fp32: the saved bf16 values, upcast
            logits[name] = model(ids).logits[:, -last:].float().cpu().numpy()
    np.savez(os.path.join(work, "hf_logits.npz"), **logits)
    with open(os.path.join(work, "hf.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()

"""The Hugging Face half of benchmarks/bench_inference.py: ZayaForCausalLM (PyTorch, its own cache) on the weights the
driver exported, measuring what the JAX half measures. Imports no JAX (it runs in its own process, so either side
has the GPU to itself). python benchmarks/bench_inference_hf.py SPEC.json OUT.json"""

import json
import sys
import time

import numpy as np
import torch
import transformers


def timed(fn, repeats):
    fn()  # warm-up (and torch.compile's compilation)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    spec = json.load(open(sys.argv[1]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, spec["dtype"])
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(device).eval()
    out = {"load_s": round(time.perf_counter() - start, 2), "transformers": transformers.__version__,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    rng = np.random.default_rng(0)
    for name in ["eager"] + (["compiled"] if spec.get("compile") and device == "cuda" else []):
        if name == "compiled":  # what HF documents: the forward compiled, generate() unchanged
            model.forward = torch.compile(model.forward)
        try:
            out.update(measure(model, name, spec, rng, device))
        except Exception as e:  # a variant that does not run is reported, not fatal
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    prompt = torch.as_tensor([spec["greedy_prompt"]], device=device)
    with torch.no_grad():
        greedy = model.generate(prompt, do_sample=False, max_new_tokens=spec["greedy_new_tokens"],
                                min_new_tokens=spec["greedy_new_tokens"], use_cache=True, pad_token_id=0)
    out["greedy_tokens"] = greedy[0, prompt.shape[1]:].tolist()
    json.dump(out, open(sys.argv[2], "w"), indent=1)


def measure(m, name, spec, rng, device):
    out = {}
    vocab = m.config.vocab_size
    rows = {}
    for batch, length in spec["scoring"]:
        ids = torch.as_tensor(rng.integers(3, vocab, (batch, length)), device=device)

        def score():
            with torch.no_grad():
                logits = m(ids[:, :-1]).logits
                return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).sum()
        rows[f"{batch}x{length}"] = dict(tokens_per_s=batch * length / timed(score, spec["repeats"]))
    out[f"scoring_{name}"] = rows
    rows = {}
    for batch in spec["decode_batches"]:
        ids = torch.as_tensor(rng.integers(3, vocab, (batch, spec["prompt"])), device=device)
        new = spec["new_tokens"]

        def prefill():
            with torch.no_grad():
                m(ids, use_cache=True)

        def decode():
            with torch.no_grad():
                m.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new, use_cache=True,
                           pad_token_id=0)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ttft = timed(prefill, spec["repeats"])
        total = timed(decode, max(1, spec["repeats"] // 2))
        rows[str(batch)] = dict(ttft_s=ttft, decode_tokens_per_s=batch * new / max(total - ttft, 1e-9),
                                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)
    out[f"decode_{name}"] = rows
    return out


if __name__ == "__main__":
    main()

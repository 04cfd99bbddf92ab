"""The Hugging Face half of benchmarks/bench_inference.py: ZayaForCausalLM (PyTorch, bf16, its own cache) on the
weights the JAX half exported, measuring what the JAX half measures, in named phases (inference_phases.py) that
write SPEC's hf_out after each one. Imports no JAX (it runs in its own process, after the JAX one has exited).

Order: load, eager scoring, eager decode at the first decode batch sizes (1, 64), eager decode at the others (8),
then the torch.compile variant (the model body compiled; the head and generate() unchanged) of each. Decode phases
print their progress (prefill timings, a 2-token warm-up generation that compiles the step graphs) as they go.
Scoring runs the model body, then the head and log-softmax over the scored continuation only, 128 positions at a
time (as our Scorer does; lm_eval's hf backend forms every position's logits, which is slower).

python benchmarks/bench_inference_hf.py SPEC.json"""

import json
import os
import sys
import time

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inference_phases import Phases, decode_rate, timed  # noqa: E402

LOGIT_CHUNK = 128


def sync(_=None):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    spec = json.load(open(sys.argv[1]))
    phases = Phases(spec["hf_out"], spec["hf_deadline"], "hf", spec.get("phases"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, spec["dtype"])
    info = {"transformers": transformers.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    if device == "cuda":  # the JAX child has exited: its memory should be free
        free, total = torch.cuda.mem_get_info()
        info.update(gpu_free_gib_at_start=round(free / 2**30, 2), gpu_total_gib=round(total / 2**30, 2))
    phases.data["info"] = info
    print(f"[hf] {json.dumps(info)}", flush=True)
    phases.save()
    state = {}

    def load():
        start = time.perf_counter()
        try:  # straight onto the GPU
            model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype,
                                                                      device_map=device)
            how = f"device_map={device}"
        except Exception as e:  # device_map needs accelerate in some versions
            model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(device)
            how = f"from_pretrained then .to({device}) ({type(e).__name__}: {str(e)[:200]})"
        model.eval()
        # greedy for exactly max_new_tokens, as ours: no end-of-sequence stop (nor min_new_tokens' suppression of
        # it, which would change a greedy choice)
        model.generation_config.eos_token_id = None
        sync()
        state["model"] = model
        cfg = model.config
        return dict(load_s=round(time.perf_counter() - start, 2), how=how,
                    param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
                    params=sum(p.numel() for p in model.parameters()),
                    # HF's own word on whether generation with this model's cache can run as one compiled graph
                    can_compile_fullgraph=getattr(type(model), "_can_compile_fullgraph", None),
                    experts_implementation=getattr(cfg, "_experts_implementation", None),
                    attn_implementation=getattr(cfg, "_attn_implementation", None),
                    gpu_allocated_gib=torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None)

    if not phases.run("load", load, min_left_s=-float("inf")):
        return
    model = state["model"]
    first_batches = spec["decode_batches"][:2]
    later_batches = spec["decode_batches"][2:]
    variants = ["eager"] + (["compiled"] if spec.get("compile") and device == "cuda" else [])

    def run_scoring(name):
        for batch, length in spec["scoring"]:
            phases.run(f"scoring_{name}_{batch}x{length}", lambda b=batch, n=length: scoring(model, b, n),
                       min_left_s=spec["min_left"]["compiled" if name == "compiled" else "scoring"])

    def scoring(m, batch, length):
        ids = torch.as_tensor(np.load(os.path.join(spec["work"], f"scoring_{batch}x{length}.npy")).astype(np.int64),
                              device=device)  # the tokens the JAX half scored
        inputs, targets = ids[:, :-1], ids[:, 1:]
        c = spec["continuation"]

        def score():
            with torch.inference_mode():
                hidden = m.model(input_ids=inputs, use_cache=False).last_hidden_state[:, -c:]
                total = torch.zeros(batch, device=device)
                for s in range(0, c, LOGIT_CHUNK):
                    logp = torch.log_softmax(m.lm_head(hidden[:, s:s + LOGIT_CHUNK]).float(), -1)
                    total += logp.gather(-1, targets[:, -c:][:, s:s + LOGIT_CHUNK, None])[..., 0].sum(-1)
                return total
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = timed(score, sync, repeats=spec["repeats"], deadline=phases.deadline)
        logp = t.pop("value").float().cpu().tolist()
        return dict(tokens_per_s=batch * length / t["median_s"], compile_and_first_s=t["first_s"], **t, logp=logp,
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)

    def decode(m, name, batch):
        ids = torch.as_tensor(np.load(os.path.join(spec["work"], f"prompt_b{batch}.npy")).astype(np.int64),
                              device=device)
        new = spec["new_tokens"]

        def prefill():
            with torch.inference_mode():
                return m(input_ids=ids, use_cache=True, logits_to_keep=1).logits

        def generate(n=new):
            with torch.inference_mode():
                out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 use_cache=True, pad_token_id=0)[:, ids.shape[1]:]
            if out.shape[1] != n:
                raise RuntimeError(f"generate returned {out.shape[1]} new tokens, not {n}")
            return out
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ttft = timed(prefill, sync, repeats=spec["repeats"], deadline=phases.deadline)
        ttft.pop("value")
        print(f"[hf] decode_{name}_{batch}: prefill first {ttft['first_s']} s, median {ttft['median_s']:.4f} s",
              flush=True)
        # warm-up on a short generation (compiled: its first step and the dynamic-length steps compile here), then
        # every full one is a measurement
        start = time.perf_counter()
        generate(2)
        sync()
        warm = round(time.perf_counter() - start, 3)
        print(f"[hf] decode_{name}_{batch}: 2-token warm-up generation {warm} s", flush=True)
        gen = timed(generate, sync, repeats=spec["repeats"], deadline=phases.deadline, cap_s=spec["decode_cap_s"],
                    warmed=True)
        tokens = gen.pop("value").cpu().numpy().astype(np.int32)
        np.save(os.path.join(spec["work"], f"tokens_hf_{name}_b{batch}.npy"), tokens)
        out = dict(ttft_s=ttft["median_s"],
                   decode_tokens_per_s=decode_rate(batch * new, gen["median_s"], ttft["median_s"]),
                   tokens_per_s_with_prefill=batch * new / gen["median_s"], generate_s=gen["median_s"],
                   warmup_generate_2_s=warm, ttft_timing=ttft, generate_timing=gen,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)
        if batch == 1:
            out["tokens"] = tokens[0].tolist()
        return out

    def run_decode(name, batches):
        for batch in batches:
            phases.run(f"decode_{name}_{batch}", lambda b=batch: decode(model, name, b),
                       min_left_s=spec["min_left"]["compiled" if name == "compiled" else "decode"])

    run_scoring("eager")
    run_decode("eager", first_batches)
    run_decode("eager", later_batches)
    if "compiled" in variants:
        def compile_body():  # what HF documents for generation: the forward compiled, generate() unchanged
            model.model.forward = torch.compile(model.model.forward)
            return {"compiled": "model.model.forward"}
        if phases.run("compile", compile_body, min_left_s=spec["min_left"]["compiled"]):
            run_scoring("compiled")
            run_decode("compiled", spec["decode_batches"])
    peaks = [v["peak_gib"] for v in phases.data.values() if isinstance(v, dict) and v.get("peak_gib")]
    phases.data["peak_gib"] = max(peaks, default=None)
    phases.save()


if __name__ == "__main__":
    main()

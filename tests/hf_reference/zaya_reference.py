"""Hugging Face ZAYA reference runner. Run with the reference venv (torch + transformers), never with jax:

    .venv-ref/bin/python tests/hf_reference/zaya_reference.py SPEC.json

SPEC.json = {"jobs": [job, ...]}; one process runs every job so torch/transformers are imported once.
Each job writes its results to job["out_dir"]:

- "build": ZayaForCausalLM(config) in fp32 with eager attention, every parameter and the balancing biases set to
  random non-default values (seeded), saved with save_pretrained to out_dir/hf_model. For `skip_layers`, the skip
  bias of that layer is placed inside the spread of the router's scores so the skip class wins for some tokens
  and not for others. Then, per case (input_ids, optional attention_mask, labels with -100 at ignored positions):
  forward, HF loss, backward. Writes reference.npz ("{case}::logits", "{case}::loss", "{case}::grad::{HF key}")
  and report.json (skip/expert selections per layer, smallest routing margin, file-vs-memory check).
  The in-memory model is the reference: transformers re-initialises the skip bias when it *loads* a checkpoint,
  so a reloaded model would differ whenever the skip bias is not -1.
- "auto": AutoModelForCausalLM and AutoTokenizer.from_pretrained(model_dir) (an exported run): ids of job["texts"],
  their logits, the tokenizer's and generation config's eos.
- "load": ZayaForCausalLM.from_pretrained(model_dir) (a directory we exported) and logits per case ->
  reference.npz ("{case}::logits") and report.json (the balancing biases as loaded).
- "train": ZayaForCausalLM.from_pretrained(model_dir) (fp32, eager attention), its balancing biases then set to
  job["balancing_biases"] (undoing the skip-bias reset on load, see above), trained for job["steps"] steps with
  torch.optim.AdamW(**job["adamw"]) on every parameter, batch = job["batches"][step % len] (token ids
  [B, T+1], labels = ids: HF's own shifted loss), no clipping, constant lr. Writes reference.npz ("losses"
  [steps], "counts" [steps, L, E+1] tokens per router class, "margins" [steps, L] smallest top-1 vs top-2 biased
  score gap (both over the T positions that predict a label), "final::{HF key}" the trained parameters) and
  report.json (the balancing biases after training).
- "count": parameter counts of ZayaForCausalLM(config) built on the meta device (no memory) -> report.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import ZayaConfig, ZayaForCausalLM


def make_config(config: dict) -> ZayaConfig:
    cfg = ZayaConfig(**config)
    cfg._attn_implementation = "eager"
    return cfg


# ---- random non-default values ------------------------------------------------------------------------------------

def _random_value(name: str, p: torch.Tensor, g: torch.Generator, cfg: ZayaConfig) -> torch.Tensor:
    """A random value for parameter `name` on the scale that keeps a few layers well conditioned."""
    def normal(std):
        return torch.randn(p.shape, generator=g) * std

    def uniform(lo, hi):
        return lo + (hi - lo) * torch.rand(p.shape, generator=g)

    if name.endswith("embed_tokens.weight"):  # also the tied head: logits of std ~2
        return normal(2.0 * cfg.hidden_size ** -0.5)
    if name.endswith("qk_norm.temp"):
        return uniform(0.5, 1.5)
    if name.endswith("experts.gate_up_proj"):
        return normal(cfg.hidden_size ** -0.5)
    if name.endswith("experts.down_proj"):
        return normal(cfg.moe_intermediate_size ** -0.5)
    if name.endswith("conv_qk_depthwise.weight"):
        return normal(p.shape[-1] ** -0.5)
    if name.endswith("conv_qk_grouped.weight"):
        return normal((p.shape[1] * p.shape[2]) ** -0.5)
    if p.ndim == 2 and name.endswith(".weight"):  # nn.Linear [out, in]
        return normal(p.shape[1] ** -0.5)
    if p.ndim == 1 and (name.endswith("_scale") or name.endswith("norm.weight")):
        return uniform(0.6, 1.4)
    if p.ndim == 1 and (name.endswith("bias")):
        return normal(0.2)
    raise ValueError(f"no randomisation rule for parameter {name} {tuple(p.shape)}")


def randomize(model: ZayaForCausalLM, cfg: ZayaConfig, seed: int) -> list[str]:
    """Sets every parameter and every persistent buffer; returns the names of the buffers left alone."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_random_value(name, p, g, cfg))
        untouched = []
        for name, b in model.named_buffers():
            if name.endswith("balancing_biases"):
                b[:-1] = (torch.rand(b.shape[0] - 1, generator=g) - 0.5) * 0.1
                b[-1] = -0.6 - 0.3 * torch.rand((), generator=g)
            else:
                untouched.append(name)  # rotary inv_freq: non-persistent, derived from the config
    return untouched


# ---- routing diagnostics ------------------------------------------------------------------------------------------

def _capture_router_logits(model):
    captured = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        def hook(module, args, out, l=l):
            captured[l] = out.detach().reshape(-1, out.shape[-1])
        hooks.append(layer.mlp.gate.router_mlp.register_forward_hook(hook))
    return captured, hooks


def _scores(logits: torch.Tensor, biases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    return probs, probs + biases


def routing_stats(model, cases) -> dict:
    """Per layer: tokens per router class and the smallest top-1 vs top-2 score margin (ambiguity check)."""
    captured, hooks = _capture_router_logits(model)
    stats = {}
    with torch.no_grad():
        for case in cases:
            ids, mask = _inputs(case)
            model(input_ids=ids, attention_mask=mask)
            real = (mask.reshape(-1) > 0) if mask is not None else torch.ones(ids.numel(), dtype=torch.bool)
            for l, logits in captured.items():
                gate = model.model.layers[l].mlp.gate
                _, score = _scores(logits, gate.balancing_biases)
                score = score[real]
                top2 = torch.topk(score, 2, dim=-1).values
                counts = torch.bincount(score.argmax(-1), minlength=score.shape[-1]).tolist()
                s = stats.setdefault(f"{case['name']}/layer{l}", {})
                s["class_counts"] = counts
                s["min_margin"] = float((top2[:, 0] - top2[:, 1]).min())
    for h in hooks:
        h.remove()
    return stats


def place_skip_bias(model, layer: int, cases) -> dict:
    """Sets layer's skip bias at the midpoint of the widest gap in the middle of the per-token thresholds
    (best expert score - skip probability): the skip class then wins for some tokens, far from any tie."""
    captured, hooks = _capture_router_logits(model)
    thresholds = []
    with torch.no_grad():
        for case in cases:
            ids, mask = _inputs(case)
            model(input_ids=ids, attention_mask=mask)
            gate = model.model.layers[layer].mlp.gate
            probs, score = _scores(captured[layer], gate.balancing_biases)
            if mask is not None:
                keep = mask.reshape(-1) > 0
                probs, score = probs[keep], score[keep]
            thresholds.append(score[:, :-1].max(-1).values - probs[:, -1])
    for h in hooks:
        h.remove()
    t = torch.sort(torch.cat(thresholds)).values
    n = t.numel()
    lo, hi = n // 4, max(n // 4 + 1, (3 * n) // 4)
    gaps = t[lo + 1:hi + 1] - t[lo:hi]
    i = lo + int(torch.argmax(gaps))
    bias = float((t[i] + t[i + 1]) / 2)
    with torch.no_grad():
        model.model.layers[layer].mlp.gate.balancing_biases[-1] = bias
    return {"layer": layer, "skip_bias": bias, "half_gap": float((t[i + 1] - t[i]) / 2)}


# ---- jobs ----------------------------------------------------------------------------------------------------------

def _inputs(case):
    ids = torch.tensor(case["input_ids"], dtype=torch.long)
    mask = case.get("attention_mask")
    return ids, (torch.tensor(mask, dtype=torch.long) if mask is not None else None)


def run_build(job: dict, out: Path) -> None:
    cfg = make_config(job["config"])
    torch.manual_seed(job["seed"])
    model = ZayaForCausalLM(cfg).float().eval()
    untouched = randomize(model, cfg, job["seed"])
    cases = job["cases"]
    skip = [place_skip_bias(model, l, cases) for l in job.get("skip_layers", [])]

    arrays, losses = {}, {}
    for case in cases:
        ids, mask = _inputs(case)
        labels = torch.tensor(case["labels"], dtype=torch.long)
        model.zero_grad(set_to_none=True)
        result = model(input_ids=ids, attention_mask=mask, labels=labels)
        result.loss.backward()
        name = case["name"]
        arrays[f"{name}::logits"] = result.logits.detach().numpy()
        arrays[f"{name}::loss"] = result.loss.detach().numpy()
        losses[name] = float(result.loss.detach())
        for key, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            arrays[f"{name}::grad::{key}"] = grad.detach().numpy()
    np.savez(out / "reference.npz", **arrays)

    model.save_pretrained(out / "hf_model")
    report = {"losses": losses, "skip": skip, "routing": routing_stats(model, cases),
              "untouched_buffers": untouched, "file_matches_memory": _file_matches_memory(model, out / "hf_model")}
    (out / "report.json").write_text(json.dumps(report, indent=1))


def _file_matches_memory(model, directory: Path) -> bool:
    """save_pretrained must have written exactly the in-memory parameters and balancing biases."""
    saved = {}
    for f in sorted(directory.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    state = model.state_dict()  # persistent entries only
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)


def run_load(job: dict, out: Path) -> None:
    model = ZayaForCausalLM.from_pretrained(job["model_dir"], attn_implementation="eager", dtype=torch.float32)
    model.eval()
    arrays = {}
    with torch.no_grad():
        for case in job["cases"]:
            ids, mask = _inputs(case)
            arrays[f"{case['name']}::logits"] = model(input_ids=ids, attention_mask=mask).logits.numpy()
    np.savez(out / "reference.npz", **arrays)
    biases = [layer.mlp.gate.balancing_biases.tolist() for layer in model.model.layers]
    (out / "report.json").write_text(json.dumps({"balancing_biases": biases}, indent=1))


def run_auto(job: dict, out: Path) -> None:
    """AutoModelForCausalLM + AutoTokenizer.from_pretrained(model_dir): the texts' ids and their logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], attn_implementation="eager", dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    arrays, ids_of = {}, []
    with torch.no_grad():
        for i, text in enumerate(job["texts"]):
            ids = tokenizer(text)["input_ids"]
            ids_of.append(ids)
            arrays[f"{i}::logits"] = model(input_ids=torch.tensor([ids])).logits.numpy()
    np.savez(out / "reference.npz", **arrays)
    biases = [layer.mlp.gate.balancing_biases.tolist() for layer in model.model.layers]
    gen = model.generation_config
    (out / "report.json").write_text(json.dumps({
        "balancing_biases": biases, "ids": ids_of, "model_class": type(model).__name__,
        "eos_token_id": tokenizer.eos_token_id, "generation_eos": gen.eos_token_id,
        "decoded": [tokenizer.decode(ids) for ids in ids_of]}, indent=1))


def _routing_of_step(model, captured, ids) -> tuple[np.ndarray, np.ndarray]:
    """Tokens per router class [L, E+1] and the smallest top-1 vs top-2 biased score gap [L] of the last forward,
    over the positions that predict a label (the last position of each row predicts nothing)."""
    counts, margins = [], []
    for l, layer in enumerate(model.model.layers):
        logits = captured[l].reshape(*ids.shape, -1)[:, :-1].reshape(-1, captured[l].shape[-1])
        _, score = _scores(logits, layer.mlp.gate.balancing_biases)
        top2 = torch.topk(score, 2, dim=-1).values
        counts.append(torch.bincount(score.argmax(-1), minlength=score.shape[-1]).numpy())
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
    return np.stack(counts), np.asarray(margins)


def run_train(job: dict, out: Path) -> None:
    # One intra-op thread: for a model this small a second thread only adds synchronisation, and on a busy
    # 2-core machine its spin-waiting made the 30 steps 4-15x slower (3 s vs 14-58 s measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train(job, out)
    finally:
        torch.set_num_threads(threads)


def _train(job: dict, out: Path) -> None:
    model = ZayaForCausalLM.from_pretrained(job["model_dir"], attn_implementation="eager", dtype=torch.float32)
    model.train()  # no dropout anywhere in ZAYA (attention_dropout 0); train() only for realism
    with torch.no_grad():
        for layer, biases in zip(model.model.layers, job["balancing_biases"], strict=True):
            layer.mlp.gate.balancing_biases.copy_(torch.tensor(biases, dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), **job["adamw"])  # tied head: one parameter, as on our side
    captured, hooks = _capture_router_logits(model)
    batches = [torch.tensor(b, dtype=torch.long) for b in job["batches"]]
    losses, counts, margins = [], [], []
    for step in range(job["steps"]):
        ids = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        c, m = _routing_of_step(model, captured, ids)
        counts.append(c)
        margins.append(m)
    for h in hooks:
        h.remove()
    arrays = {"losses": np.asarray(losses), "counts": np.stack(counts), "margins": np.stack(margins)}
    arrays.update({f"final::{k}": p.detach().numpy() for k, p in model.named_parameters()})
    np.savez(out / "reference.npz", **arrays)
    biases_after = [layer.mlp.gate.balancing_biases.tolist() for layer in model.model.layers]
    (out / "report.json").write_text(json.dumps({"biases_after": biases_after}))


def run_count(job: dict, out: Path) -> None:
    cfg = ZayaConfig(**job["config"])
    with torch.device("meta"):
        model = ZayaForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    embed = model.model.embed_tokens.weight
    # embedding = the table plus whatever the head owns beyond it (untied weight, bias)
    embedding = embed.numel() + sum(p.numel() for p in model.lm_head.parameters() if p is not embed)
    inactive = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                   for layer in model.model.layers) * (cfg.num_experts - 1) // cfg.num_experts
    report = {"total": total, "embedding": embedding, "non_embedding": total - embedding,
              "active_non_embedding": total - embedding - inactive}
    (out / "report.json").write_text(json.dumps(report, indent=1))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    runners = {"build": run_build, "load": run_load, "train": run_train, "count": run_count,
               "auto": run_auto}
    for job in spec["jobs"]:
        out = Path(job["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        runners[job["mode"]](job, out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    main(sys.argv[1])

"""Inference on one GPU, ours against Hugging Face's ZayaForCausalLM (PyTorch, bf16, its cache; also with its
forward under torch.compile) on the same random-initialised weights: lm-eval-style scoring throughput, greedy
decode tokens/s and time to first token at several batch sizes, peak memory, and the decode bandwidth roofline
(bytes read per decode step against the measured copy bandwidth). Each half runs in its own process (the GPU to
itself): `prepare` exports the weights as a HF directory, `hf` runs benchmarks/bench_inference_hf.py, `jax` this file.

python -m benchmarks.bench_inference [--preset bench|zaya1_8b|tiny] [--out FILE.json] [--hf-python PYTHON] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def spec_for(args, model_dir):
    quick = args.quick
    return dict(model_dir=model_dir, dtype="bfloat16", repeats=2 if quick else 5, compile=not quick,
                scoring=[[2, 64]] if quick else [[32, 1024], [8, 4096]],
                decode_batches=[1, 2] if quick else [1, 8, 64], prompt=16 if quick else 512,
                new_tokens=8 if quick else 256, greedy_prompt=[2, 17, 33, 65, 129, 7, 11, 13],
                greedy_new_tokens=8 if quick else 32)


def prepare(spec, preset_name):
    import jax.numpy as jnp
    from flax import nnx

    from zaya_jax.checkpoint.hf import to_hf
    from zaya_jax.config import preset
    from zaya_jax.model import ZayaForCausalLM
    model = ZayaForCausalLM(preset(preset_name, dtype="bfloat16"), rngs=nnx.Rngs(0))
    to_hf(model, spec["model_dir"], dtype=jnp.bfloat16)


def timed(fn, repeats):
    import jax
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_jax(spec):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax.checkpoint.hf import from_hf
    from zaya_jax.inference.decoder import Decoder
    from zaya_jax.inference.generate import generate_padded
    from zaya_jax.inference.scoring import Scorer
    from zaya_jax.param_count import abstract_param_counts

    start = time.perf_counter()
    model = from_hf(spec["model_dir"], dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    jax.block_until_ready(jax.tree.leaves(model))
    out = {"load_s": round(time.perf_counter() - start, 2), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind}
    cfg = model.cfg
    rng = np.random.default_rng(0)

    x = jnp.ones((256, 1024, 1024), jnp.float32)  # 1 GiB read and written per call
    out["copy_gb_per_s"] = 2 * x.nbytes / timed(lambda: x + 1, spec["repeats"]) / 1e9
    del x

    scoring = {}
    for batch, length in spec["scoring"]:
        scorer = Scorer(model, max_length=length, batch_size=batch, buckets=(length,))
        tokens = rng.integers(3, cfg.vocab_size, (batch, length + 1)).tolist()
        requests = [(t[:-32], t[-32:]) for t in tokens]  # the loss over each row's last 32 tokens
        scoring[f"{batch}x{length}"] = dict(tokens_per_s=batch * length / timed(
            lambda: scorer.loglikelihood(requests), spec["repeats"]))
    out["scoring"] = scoring

    decoder = Decoder(model)
    counts = abstract_param_counts(cfg)
    decode = {}
    for batch in spec["decode_batches"]:
        ids = rng.integers(3, cfg.vocab_size, (batch, spec["prompt"])).astype(np.int32)
        new = spec["new_tokens"]
        max_length = spec["prompt"] + new

        def prefill():
            return decoder.prefill(decoder.init_cache(batch, max_length), ids)

        ttft = timed(prefill, spec["repeats"])
        total = timed(lambda: generate_padded(decoder, ids, max_new_tokens=new).tokens, max(1, spec["repeats"] // 2))
        cache = decoder.init_cache(batch, max_length)
        cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache)) * (spec["prompt"] + new / 2) / max_length
        experts_read = cfg.num_experts * (1 - (1 - 1 / cfg.num_experts) ** batch)  # distinct experts per layer
        expert_params = (counts["non_embedding"] - counts["active_non_embedding"]) / (cfg.num_experts - 1)
        weight_bytes = 2 * (counts["active_non_embedding"] + (experts_read - 1) * expert_params
                            + cfg.vocab_size * cfg.hidden_size)  # bf16; the head reads the whole vocabulary
        step_bytes = weight_bytes + cache_bytes
        decode[str(batch)] = dict(ttft_s=ttft, decode_tokens_per_s=batch * new / max(total - ttft, 1e-9),
                                  step_bytes=step_bytes,
                                  roofline_tokens_per_s=batch * out["copy_gb_per_s"] * 1e9 / step_bytes)
        del cache
    out["decode"] = decode
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30 or None
    greedy = generate_padded(decoder, np.asarray([spec["greedy_prompt"]], np.int32),
                             max_new_tokens=spec["greedy_new_tokens"])
    out["greedy_tokens"] = greedy.tokens[0].tolist()
    return out


def ratios(ours, hf):
    """ours / HF's best variant, per measurement."""
    out = {}
    for kind, key in (("scoring", "tokens_per_s"), ("decode", "decode_tokens_per_s")):
        for shape, row in ours[kind].items():
            best = max((hf[f"{kind}_{v}"][shape][key] for v in ("eager", "compiled") if f"{kind}_{v}" in hf),
                       default=None)
            out[f"{kind}_{shape}"] = row[key] / best if best else None
    for batch, row in ours["decode"].items():
        out[f"decode_{batch}_of_roofline"] = row["decode_tokens_per_s"] / row["roofline_tokens_per_s"]
    same = 0
    for a, b in zip(ours["greedy_tokens"], hf["greedy_tokens"]):
        if a != b:
            break
        same += 1
    out["greedy_tokens_equal_to_hf"] = f"{same} of {len(hf['greedy_tokens'])}"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", help="model preset (bench, zaya1_8b, tiny)")
    ap.add_argument("--out", default=None, help="write the results and ratios as JSON")
    ap.add_argument("--hf-python", default=sys.executable, help="python with torch and transformers >= 5.23")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU check of the script)")
    ap.add_argument("--phase", choices=["prepare", "jax"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:  # a child process
        spec = json.load(open(args.spec))
        if args.phase == "prepare":
            prepare(spec, args.preset)
        else:
            json.dump(run_jax(spec), open(spec["jax_out"], "w"), indent=1)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_for(args, os.path.join(tmp, "model"))
        spec["jax_out"], hf_out = os.path.join(tmp, "jax.json"), os.path.join(tmp, "hf.json")
        spec_path = os.path.join(tmp, "spec.json")
        json.dump(spec, open(spec_path, "w"))
        me = [sys.executable, "-m", "benchmarks.bench_inference", "--preset", args.preset, "--spec", spec_path]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run(me + ["--phase", "prepare"], check=True, cwd=ROOT, env=env)
        subprocess.run([args.hf_python, os.path.join(HERE, "bench_inference_hf.py"), spec_path, hf_out], check=True)
        subprocess.run(me + ["--phase", "jax"], check=True, cwd=ROOT, env=env)
        ours, hf = json.load(open(spec["jax_out"])), json.load(open(hf_out))
    result = dict(preset=args.preset, spec={k: v for k, v in spec.items() if k not in ("model_dir", "jax_out")},
                  ours=ours, hf=hf, ratios=ratios(ours, hf))
    print(json.dumps(result["ratios"], indent=1))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

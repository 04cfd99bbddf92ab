"""from_hf of a full-size checkpoint written by Hugging Face itself: transformers' ZayaForCausalLM, random-initialised
on the device and saved by save_pretrained (bf16, sharded safetensors), loaded with zaya_jax.from_hf (load time), its
logits against HF's on the same token ids in fp32 (the saved bf16 weights upcast on both sides) and in bf16.

python -m benchmarks.from_hf_h200 WORK [--preset zaya1_8b] [--hf-python PYTHON] [--device cuda] [--out FILE.json]

The HF half runs first as its own process (benchmarks/from_hf_hf_side.py, PyTorch only) and exits before JAX takes
the device. Relative errors are max |ours - HF| / max |HF| over the last --last positions of each row. On the CPU:
--preset tiny --hf-python .venv-ref/bin/python --device cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--hf-python", default=sys.executable)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--last", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from zaya_jax.config import preset
    cfg = preset(args.preset)
    os.makedirs(os.path.join(args.work, "init"), exist_ok=True)
    with open(os.path.join(args.work, "init", "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (args.batch, args.length)).astype(np.int64)
    np.save(os.path.join(args.work, "ids.npy"), ids)
    side = os.path.join(os.path.dirname(os.path.abspath(__file__)), "from_hf_hf_side.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    start = time.perf_counter()
    proc = subprocess.run([args.hf_python, side, args.work, args.device, str(args.last)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"from_hf_h200: the HF half failed:\n{proc.stderr[-3000:]}")
    result = dict(preset=args.preset, batch=args.batch, length=args.length, last_positions=args.last,
                  hf=json.load(open(os.path.join(args.work, "hf.json"))),
                  hf_process_s=round(time.perf_counter() - start, 1))
    shards = [f for f in os.listdir(os.path.join(args.work, "hf")) if f.endswith(".safetensors")]
    result["hf"]["shards"] = len(shards)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zaya_jax
    from zaya_jax.inference.kernels import with_config
    hf = np.load(os.path.join(args.work, "hf_logits.npz"))
    start = time.perf_counter()
    model = zaya_jax.from_hf(os.path.join(args.work, "hf"), dtype=jnp.float32)  # fp32 parameters
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    result["load_s"] = round(time.perf_counter() - start, 1)
    # the compute dtype (the parameters are loaded once); fp32 also with fp32 GEMMs (JAX's default lets the GPU
    # round fp32 GEMM inputs to TF32)
    for name, dtype, precision in (("float32", "float32", None), ("float32_highest", "float32", "highest"),
                                   ("bfloat16", "bfloat16", None)):
        computing = with_config(model, model.cfg.replace(dtype=dtype))
        with jax.default_matmul_precision(precision):
            ours = np.asarray(jax.jit(lambda m, x: m(x)[:, -args.last:])(computing, jnp.asarray(ids, jnp.int32)),
                              np.float32)
        theirs = hf[dtype]
        result[name] = dict(max_rel=float(np.abs(ours - theirs).max() / np.abs(theirs).max()),
                             max_abs_logit=float(np.abs(theirs).max()),
                             argmax_agreement=float((ours.argmax(-1) == theirs.argmax(-1)).mean()))
        print(name, result[name], flush=True)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

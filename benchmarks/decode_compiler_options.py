"""The greedy decode loop compiled under several sets of XLA compiler options, timed in one process on the same
weights and prompt: which options make a single-token step's many small kernels cheaper (command buffers off, or
capturing the loop and the custom calls too; concurrent regions in the command buffer; Triton fusions of the
reductions). Per variant: the median over repeats of the decode loop alone (the prefill is run before each repeat
and not timed), as ms per token, and an error if XLA refused the options.

python -m benchmarks.decode_compiler_options [--preset zaya1_8b] [--batch 1] [--prompt 512] [--new-tokens 64]
                                             [--repeats 5] [--variants base,concurrent,...] [--out FILE.json]"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_inference import init_model
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.generate import _decode_loop, length_bucket
from zaya_jax.inference.sampling import GREEDY

VARIANTS = {
    "base": {},
    # whether the step's kernels are replayed from CUDA graphs at all, and with the loop and every custom call (the
    # Pallas kernels) captured too: a batch-1 step is ~1200 small kernels, so launches may bound it
    "no_command_buffer": {"xla_gpu_enable_command_buffer": ""},
    "command_buffer_all": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
        "xla_gpu_graph_min_graph_size": 1},
    "concurrent": {"xla_gpu_graph_enable_concurrent_region": True},
    # programmatic dependent launch: a kernel's launch and prologue overlap the previous kernel's tail
    "pdl": {"xla_gpu_enable_pdl": True},
    "triton_softmax": {"xla_gpu_experimental_enable_triton_softmax_priority_fusion": True},
    "heroless": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
    "all_triton": {"xla_gpu_experimental_all_fusions_with_triton": True},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    decoder = Decoder(init_model(args.preset), kernels="auto")
    ids = np.random.default_rng(0).integers(3, decoder.cfg.vocab_size, (args.batch, args.prompt)).astype(np.int32)
    steps = length_bucket(args.new_tokens)
    report = dict(preset=args.preset, device=jax.devices()[0].device_kind, batch=args.batch, prompt=args.prompt,
                  new_tokens=args.new_tokens, repeats=args.repeats, variants={})
    reference = None
    for name in args.variants.split(","):
        options = VARIANTS[name]
        loop = jax.jit(functools.partial(_decode_loop, decoder.step_graphdef), static_argnames=("sampling", "steps"),
                       donate_argnums=1, compiler_options=options)

        def run():
            cache = decoder.init_cache(args.batch, length_bucket(args.prompt + steps))
            logits, cache = decoder.prefill(cache, ids)
            jax.block_until_ready(logits)
            start = time.perf_counter()
            out = loop(decoder.state, cache, logits, jax.random.key(0), jnp.asarray([-1], jnp.int32), jnp.int32(0),
                       jnp.int32(args.new_tokens), sampling=GREEDY, steps=steps)
            tokens = np.asarray(out[0])
            return time.perf_counter() - start, tokens

        try:
            start = time.perf_counter()
            _, tokens = run()
            compile_s = time.perf_counter() - start
            times = [run()[0] for _ in range(args.repeats)]
        except Exception as e:  # an option this XLA does not know, or one it cannot compile with
            report["variants"][name] = dict(options=options, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(name, "failed:", report["variants"][name]["error"], flush=True)
            continue
        reference = tokens if reference is None else reference
        ms = float(np.median(times)) * 1e3 / args.new_tokens
        report["variants"][name] = dict(options=options, ms_per_token=ms, tokens_per_s=args.batch * 1e3 / ms,
                                        first_call_s=compile_s, same_tokens_as_first=bool((tokens == reference).all()),
                                        times_s=times)
        print(name, f"{ms:.3f} ms/token", flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

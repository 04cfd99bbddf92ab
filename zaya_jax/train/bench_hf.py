"""The Hugging Face side of the training benchmark (zaya_jax/train/bench.py starts this as its own process; it never
imports jax or zaya_jax):

    python zaya_jax/train/bench_hf.py --config hf_config.json --batch 2 --seq 4096 --workdir DIR --out hf.json

transformers' ZayaForCausalLM built from our config.json dict, bf16 parameters, SDPA attention, the experts
implementation asked for (`grouped_mm`: transformers 5.23 reads config._experts_implementation, also settable as
`experts_implementation=` in from_pretrained/_from_config; None resolves to grouped_mm when available), fused
torch.optim.AdamW; one training step = forward with labels (HF's own shifted, fp32-upcast loss), backward, AdamW
step, zero_grad. Timed eager, then under torch.compile(model), with CUDA events, medians after warm-up.

Protocol with the JAX process (files in --workdir): compile/warm up first, write `hf_compiled`; time only after
`jax_compiled` exists (or the deadline), each timed region under the exclusive lock `gpu.lock`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import time
import traceback


@contextlib.contextmanager
def gpu_lock(path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--t0", type=float, default=None)
    ap.add_argument("--budget", type=float, default=1e9)
    ap.add_argument("--experts", default="grouped_mm")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--ceiling-size", type=int, default=8192)
    args = ap.parse_args()
    t0 = args.t0 or time.time()
    deadline = lambda frac: t0 + args.budget * frac  # noqa: E731
    lock = os.path.join(args.workdir, "gpu.lock")
    report = {"batch": args.batch, "seq": args.seq, "errors": {}}

    def save():
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    def log(msg):
        print(f"[hf {time.time() - t0:6.1f}s] {msg}", flush=True)

    import torch
    import transformers
    from transformers import ZayaConfig, ZayaForCausalLM

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    report.update(torch_version=torch.__version__, transformers_version=transformers.__version__,
                  device=torch.cuda.get_device_name() if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    with open(args.config) as f:
        hf_dict = json.load(f)
    hf_dict = {k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")}
    cfg = ZayaConfig(**hf_dict)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = args.experts
    torch.manual_seed(0)
    with dev:
        model = ZayaForCausalLM(cfg)
    model = model.to(torch.bfloat16).train()
    report["experts_implementation"] = model.config._experts_implementation
    report["attn_implementation"] = model.config._attn_implementation
    report["params"] = sum(p.numel() for p in model.parameters())
    log(f"built: {report['params'] / 1e9:.3f}B params, experts={report['experts_implementation']}, "
        f"attn={report['attn_implementation']}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    runners = {"eager": model}
    warm = {}
    for name in ("eager", "compiled"):
        if name == "compiled":
            if args.no_compile:
                continue
            runners[name] = torch.compile(model)
        try:
            t = time.time()
            for _ in range(args.warmup):
                step(runners[name])
            sync()
            warm[name] = time.time() - t
            log(f"{name}: warm-up {warm[name]:.1f}s")
        except Exception as e:  # noqa: BLE001
            report[name] = {"error": repr(e)[:2000]}
            traceback.print_exc()
            runners.pop(name, None)
            if cuda:
                torch.cuda.empty_cache()
        save()
    open(os.path.join(args.workdir, "hf_compiled"), "w").close()

    # wait for the JAX side to finish compiling (its autotuning runs kernels on the GPU)
    while not os.path.exists(os.path.join(args.workdir, "jax_compiled")) and time.time() < deadline(0.6):
        time.sleep(0.5)

    def timed(fn, reps):
        times = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return times

    wants = os.path.join(args.workdir, "hf_wants")
    open(wants, "w").close()  # the JAX side lets this process time first
    with gpu_lock(lock):
        try:
            n = args.ceiling_size if cuda else 512
            x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                x @ y
            sync()
            report["gemm_ceiling_tflops_torch"] = 2 * n ** 3 / median(timed(lambda: x @ y, 10)) / 1e12
            report["ceiling_size"] = n
            del x, y
            log(f"torch GEMM ceiling {report['gemm_ceiling_tflops_torch']:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            report["errors"]["gemm_ceiling"] = repr(e)
    save()

    for name, m in runners.items():
        if time.time() > deadline(0.78):
            report[name] = {"error": "skipped: out of time"}
            continue
        try:
            with gpu_lock(lock):
                step(m)  # one more warm-up right before timing
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                first = timed(lambda: step(m), 1)[0]
                reps = max(2, min(args.steps, int((deadline(0.78) - time.time()) / max(first, 1e-3) / 2)))
                times = timed(lambda: step(m), reps)
                losses = [float(step(m)) for _ in range(1)]
                sync()
            med = median(times)
            report[name] = {"median_s": med, "step_times_s": times, "tokens_per_s": args.batch * args.seq / med,
                            "warmup_s": warm.get(name), "loss": losses[-1],
                            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}
            log(f"{name}: median {med * 1e3:.1f} ms, {report[name]['tokens_per_s']:,.0f} tok/s, "
                f"peak {report[name]['peak_memory_gib'] or 0:.1f} GiB")
        except Exception as e:  # noqa: BLE001
            report[name] = {"error": repr(e)[:2000]}
            traceback.print_exc()
        save()
    if os.path.exists(wants):
        os.remove(wants)
    open(os.path.join(args.workdir, "hf_timed"), "w").close()
    log("done")


if __name__ == "__main__":
    main()

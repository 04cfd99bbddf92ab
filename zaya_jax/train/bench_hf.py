"""The Hugging Face side of the training benchmark (zaya_jax/train/bench_hf_driver.py starts this as its own
process; it never imports jax or zaya_jax):

    python zaya_jax/train/bench_hf.py --config hf_config.json --batch 2 --seq 4096 --workdir DIR --out hf.json

transformers' ZayaForCausalLM built from our config.json dict, bf16 parameters, SDPA attention, the experts
implementation asked for (`grouped_mm`: transformers 5.23 reads config._experts_implementation), fused
torch.optim.AdamW. Measured eager, then under torch.compile(model), with CUDA events, medians after warm-up:
- `step`: forward with labels (HF's own shifted, fp32-upcast loss), backward, AdamW step, zero_grad;
- `fwd_bwd`: forward + backward only, gradients accumulating into .grad (a microbatch of gradient accumulation);
- `optimizer`: AdamW step alone (the once-per-k part of gradient accumulation).
With accumulation over k microbatches HF's step would cost k * fwd_bwd + optimizer; the report derives that
figure from these two measurements (bench_report.py) and says so.

Protocol with the JAX process (files in --workdir): warm up / compile first, write `hf_compiled`; time only after
`jax_compiled` exists (the JAX side has finished compiling; or the deadline passed), then exit, which frees the
GPU for the JAX timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timing-deadline", type=float, default=None, help="unix time: stop starting timed runs")
    ap.add_argument("--wait-deadline", type=float, default=None, help="unix time: stop waiting for jax_compiled")
    ap.add_argument("--experts", default="grouped_mm")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--ceiling-size", type=int, default=8192)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    timing_deadline = args.timing_deadline or float("inf")
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
    cfg = ZayaConfig(**{k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = args.experts
    torch.manual_seed(0)
    with dev:
        model = ZayaForCausalLM(cfg)
    model = model.to(torch.bfloat16).train()
    report.update(experts_implementation=model.config._experts_implementation,
                  attn_implementation=model.config._attn_implementation,
                  params=sum(p.numel() for p in model.parameters()))
    log(f"built: {report['params'] / 1e9:.3f}B params, experts={report['experts_implementation']}, "
        f"attn={report['attn_implementation']}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)

    def fwd_bwd(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

    def step(m):
        loss = fwd_bwd(m)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

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

    # the JAX side's compile autotunes kernels on this GPU: time after it has finished (run alone: no wait)
    wait_until = args.wait_deadline or 0.0
    while not os.path.exists(os.path.join(args.workdir, "jax_compiled")) and time.time() < wait_until:
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

    try:
        n = args.ceiling_size if cuda else 512
        report["gemm_ceiling_tflops_torch"] = gemm_ceiling_tflops(torch, dev, n, timed, sync)
        report["ceiling_size"] = n
        log(f"torch GEMM ceiling {report['gemm_ceiling_tflops_torch']:.0f} TFLOP/s")
    except Exception as e:  # noqa: BLE001
        report["errors"]["gemm_ceiling"] = repr(e)
    save()

    for name, m in runners.items():
        if time.time() > timing_deadline:
            report[name] = {"error": "skipped: out of time"}
            continue
        try:
            report[name] = time_runner(m, step, fwd_bwd, opt, timed, sync, args, timing_deadline, cuda, torch)
            report[name]["warmup_s"] = warm.get(name)
            r = report[name]
            log(f"{name}: step {r['median_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tok/s; fwd+bwd "
                f"{r['fwd_bwd_s'] * 1e3:.1f} ms, AdamW step {r['optimizer_s'] * 1e3:.1f} ms; "
                f"peak {r['peak_memory_gib'] or 0:.1f} GiB")
        except Exception as e:  # noqa: BLE001
            report[name] = {"error": repr(e)[:2000]}
            traceback.print_exc()
        save()
    log("done")


def gemm_ceiling_tflops(torch, dev, n: int, timed, sync) -> float:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    return 2 * n ** 3 / statistics.median(timed(lambda: a @ b, 10)) / 1e12


def time_runner(m, step, fwd_bwd, opt, timed, sync, args, deadline, cuda, torch) -> dict:
    """The full step, then forward+backward alone (gradients accumulating), then the optimizer step alone."""
    step(m)  # one more warm-up right before timing
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = timed(lambda: step(m), 1)[0]
    affordable = (deadline - time.time()) / max(first, 1e-3) / 3  # step, fwd+bwd and optimizer runs
    reps = max(2, min(args.steps, int(affordable) if affordable < args.steps else args.steps))
    times = timed(lambda: step(m), reps)
    loss = float(step(m))
    fwd_bwd(m)  # creates .grad; the timed calls accumulate into it as microbatches of accumulation do
    sync()
    fb = timed(lambda: fwd_bwd(m), reps)
    ot = timed(opt.step, reps)  # every call a full AdamW update (the gradients stay in place)
    opt.zero_grad(set_to_none=True)
    sync()
    med = statistics.median(times)
    return {"median_s": med, "step_times_s": times, "tokens_per_s": args.batch * args.seq / med, "loss": loss,
            "fwd_bwd_s": statistics.median(fb), "fwd_bwd_times_s": fb, "optimizer_s": statistics.median(ot),
            "optimizer_times_s": ot,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}


if __name__ == "__main__":
    main()

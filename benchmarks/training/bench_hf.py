"""The Hugging Face side of the training benchmark (benchmarks/training/bench_hf_driver.py starts this as its own
process; it never imports jax or zaya_jax):

    python benchmarks/training/bench_hf.py --config hf_config.json --batch 2 --seq 4096 --workdir DIR --out hf.json

transformers' ZayaForCausalLM built from our config.json dict, bf16 parameters, SDPA attention, the experts
implementation asked for (`grouped_mm`: transformers 5.23 reads config._experts_implementation), fused
torch.optim.AdamW. Measured eager, then under torch.compile(model), with CUDA events, medians after warm-up:
- `step`: forward with labels (HF's own shifted, fp32-upcast loss), backward, AdamW step, zero_grad;
- `fwd_bwd`: forward + backward only, gradients accumulating into .grad (a microbatch of gradient accumulation);
- `optimizer`: AdamW step alone (the once-per-k part of gradient accumulation);
- `accum{k}` (--accum, for the variant with the faster step): whole optimizer steps of gradient accumulation as a
  PyTorch user writes them: k forward + backward passes of (loss / k) into .grad, one AdamW step, zero_grad.
The report sets our accumulated steps against these (and, where one is missing, against k * fwd_bwd + optimizer,
derived from the two measurements above and labelled so).

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
    ap.add_argument("--accum", default="", help="comma-separated microbatch counts of measured accumulated steps")
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

    def fwd_bwd(m, scale=1.0):
        out = m(input_ids=ids, labels=ids)
        (out.loss * scale if scale != 1.0 else out.loss).backward()
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
    accum = [int(k) for k in args.accum.split(",") if k]
    timed_runners = {n: report[n]["median_s"] for n in runners if report.get(n, {}).get("median_s")}
    if accum and timed_runners:
        name = min(timed_runners, key=timed_runners.get)  # the faster HF variant
        for k in accum:
            key = f"accum{k}"
            try:
                report[name][key] = time_accumulated(runners[name], fwd_bwd, opt, k, timed, sync, args,
                                                     report[name]["fwd_bwd_s"], timing_deadline)
                r = report[name][key]
                if "median_s" in r:
                    log(f"{name}: {k} microbatches + AdamW {r['median_s'] * 1e3:.1f} ms, "
                        f"{r['tokens_per_s']:,.0f} tok/s")
            except Exception as e:  # noqa: BLE001
                report[name][key] = {"error": repr(e)[:2000]}
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


def time_accumulated(m, fwd_bwd, opt, k: int, timed, sync, args, fwd_bwd_s: float, deadline: float) -> dict:
    """Whole accumulated steps: k microbatches of (loss / k).backward() into .grad, one AdamW step, zero_grad; one
    untimed, then 2 or 3 timed (as the deadline leaves room for)."""
    def accumulated_step():
        for _ in range(k):
            fwd_bwd(m, 1.0 / k)
        opt.step()
        opt.zero_grad(set_to_none=True)

    fit = (deadline - time.time()) / max(k * fwd_bwd_s, 1e-3)  # whole steps left (inf without a deadline)
    if fit < 3:
        return {"k": k, "error": f"skipped: out of time ({k} x {fwd_bwd_s * 1e3:.1f} ms per step)"}
    accumulated_step()
    sync()
    times = timed(accumulated_step, int(min(3, fit - 1)))
    med = statistics.median(times)
    return {"k": k, "median_s": med, "step_times_s": times, "tokens_per_s": k * args.batch * args.seq / med}


if __name__ == "__main__":
    main()

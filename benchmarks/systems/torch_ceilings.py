"""The PyTorch side of crosscheck.py, run in its own process: prints one JSON line with the copy bandwidth
(y = x * 1.5 over fp32, read + write) and the bf16 n^3 GEMM throughput, timed with GPU events.
usage: python torch_ceilings.py COPY_BYTES N (standalone: imports nothing from zaya_jax)"""

from __future__ import annotations

import json
import statistics
import sys


def _seconds(torch, fn, reps: int = 7, calls: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples)


def measure(copy_bytes: int, n: int) -> dict:
    try:
        import torch
    except ImportError:
        return dict(skipped="torch is not installed")
    if not torch.cuda.is_available():  # ROCm builds answer through torch.cuda too
        return dict(skipped="torch sees no GPU")
    x = torch.randn(copy_bytes // 4, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    copy_s = _seconds(torch, lambda: torch.mul(x, 1.5, out=y))
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_s = _seconds(torch, lambda: a @ b, calls=5)
    return dict(copy_bandwidth=2 * copy_bytes / copy_s, gemm_tflops=2 * n ** 3 / gemm_s / 1e12,
                torch_version=torch.__version__, device=torch.cuda.get_device_name())


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))

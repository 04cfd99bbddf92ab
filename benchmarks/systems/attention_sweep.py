"""Attention throughput over context length at a fixed number of tokens per call: where causal attention turns
from memory bound to compute bound (the paper: around 4k-16k tokens, spec section 15).

Shapes are ZAYA1's compressed attention (H query heads, KV heads, head_dim from the ModelConfig), causal, bf16,
forward + backward as training runs it. FLOPs count the causal half: forward 2 matmuls x 2 x T^2/2 x H x d per
sequence, backward 2.5x the forward (dq, dk, dv and the recomputed scores), 3.5x in all.
Two crossovers are reported: measured (the length from which throughput stays >= 90% of its plateau) and the
roofline estimate for a fused kernel that reads q, k, v and writes o once (where its arithmetic intensity
reaches the machine balance = GEMM ceiling / HBM bandwidth, when both are known).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.ops import attention as attention_ops
from benchmarks.systems import plots
from benchmarks.systems.report import table, write_json
from benchmarks.systems.saturation import saturation_point
from benchmarks.systems.sizes import power_ladder
from benchmarks.systems.timing import calls_for, device_memory_bytes, seconds_per_call

BF16 = jnp.bfloat16
FWD_BWD = 3.5


def flops(cfg: ModelConfig, batch: int, length: int) -> float:
    forward = 2 * 2 * batch * length * length / 2 * cfg.num_attention_heads * cfg.head_dim
    return FWD_BWD * forward


def fused_bytes(cfg: ModelConfig, batch: int, length: int) -> float:
    """Forward + backward HBM traffic of a fused (flash) kernel, bf16: the forward reads q, k, v and writes o; the
    backward reads q, k, v, o, do and writes dq, dk, dv. Per token: 6 query-width + 6 kv-width vectors."""
    q_width = cfg.num_attention_heads * cfg.head_dim
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    return 2.0 * batch * length * (6 * q_width + 6 * kv_width)


def roofline_crossover(cfg: ModelConfig, peak_flops: float, hbm_bandwidth: float) -> float:
    """Context length where the fused kernel's intensity flops/bytes (linear in T) equals peak / bandwidth."""
    per_t = flops(cfg, 1, 1) / fused_bytes(cfg, 1, 1)  # intensity at T = 1; intensity(T) = per_t * T
    return peak_flops / hbm_bandwidth / per_t


def default_impl() -> str:
    if jax.default_backend() == "cpu":
        return "xla"
    from pallas_kernels.platform import vendor
    return "cudnn" if vendor() == "cuda" else "pallas"


def _program(cfg: ModelConfig, batch: int, length: int, impl: str):
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(length), 3)
    q = jax.random.normal(kq, (batch, length, H, d), BF16)
    k = jax.random.normal(kk, (batch, length, KV, d), BF16)
    v = jax.random.normal(kv, (batch, length, KV, d), BF16)

    def loss(q, k, v):
        return attention_ops.attention(q, k, v, impl=impl).astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v)


def _memory_ok(cfg: ModelConfig, batch: int, length: int, impl: str, device_bytes: int | None) -> bool:
    if device_bytes is None or impl != "xla":
        return True
    scores = batch * cfg.num_attention_heads * length * length * 4  # the unfused path materializes them
    return 4 * scores < 0.5 * device_bytes


def sweep(cfg: ModelConfig, *, tokens: int = 32768, min_len: int = 256, max_len: int = 32768, impl: str | None = None,
          target_s: float = 0.01, peak_flops: float | None = None, hbm_bandwidth: float | None = None,
          log=print) -> dict:
    impl = impl or default_impl()
    device_bytes = device_memory_bytes()
    records = []
    for length in power_ladder(min_len, max_len, 2):
        batch = max(1, tokens // length)
        if not _memory_ok(cfg, batch, length, impl, device_bytes):
            log(f"  T={length}: skipped (the unfused scores would not fit)")
            continue
        fn, args = _program(cfg, batch, length, impl)
        probe = seconds_per_call(fn, *args, reps=1, calls=1, warmup=1)
        t = seconds_per_call(fn, *args, reps=3, calls=calls_for(probe, target_s), warmup=0)
        f = flops(cfg, batch, length)
        records.append(dict(length=length, batch=batch, seconds=t, flops=f, tflops=f / t / 1e12,
                            intensity=f / fused_bytes(cfg, batch, length)))
        log(f"  T={length:>6} B={batch:>3}: {records[-1]['tflops']:.1f} TFLOP/s")
    sat = saturation_point([r["length"] for r in records], [r["tflops"] for r in records], 0.9)
    roofline = (roofline_crossover(cfg, peak_flops, hbm_bandwidth) if peak_flops and hbm_bandwidth else None)
    return dict(impl=impl, tokens_per_call=tokens, records=records, measured_crossover_length=sat.x,
                plateau_tflops=sat.plateau, roofline_crossover_length=roofline,
                shape=dict(H=cfg.num_attention_heads, KV=cfg.num_key_value_heads, d=cfg.head_dim))


def summary_table(result: dict) -> str:
    return table(result["records"], [("length", "T", ""), ("batch", "B", ""), ("tflops", "TFLOP/s", ".2f"),
                                     ("intensity", "fused FLOP/B", ".0f")])


def plot(result: dict, path: str) -> str:
    rows = result["records"]
    marks = []
    if result["measured_crossover_length"]:
        marks.append(dict(x=result["measured_crossover_length"], label="measured 90%"))
    if result["roofline_crossover_length"]:
        marks.append(dict(x=result["roofline_crossover_length"], label="roofline"))
    panel = dict(title=f"causal attention fwd+bwd ({result['impl']})", marks=marks,
                 series=[dict(label="TFLOP/s", x=[r["length"] for r in rows], y=[r["tflops"] for r in rows])])
    return plots.line_panels(path, [panel], xlabel="context length (tokens)", ylabel="TFLOP/s",
                             title="attention: memory bound -> compute bound")


def run(cfg: ModelConfig, out_dir: str, log=print, **kw) -> dict:
    result = sweep(cfg, log=log, **kw)
    write_json(f"{out_dir}/attention.json", result)
    plots.try_plot(plot, result, f"{out_dir}/attention.png", log)
    log(summary_table(result))
    measured, roofline = result["measured_crossover_length"], result["roofline_crossover_length"]
    log(f"attention reaches 90% of its plateau from T={measured and int(measured)}; roofline crossover of a fused "
        f"kernel T={roofline and round(roofline)}")
    return result

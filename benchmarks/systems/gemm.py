"""GEMM throughput over the model's own shapes and over M (tokens), and the FLOP size at which a GEMM reaches
90% of the best throughput (the paper: about 200 GFLOP on MI300X, spec section 15).

Shapes come from the ModelConfig: every projection is [M, K] x [K, N] with M = tokens in the microbatch (for the
experts, tokens routed to one expert: tune across the band balancing produces, not one size), plus the
grouped expert GEMM as the model runs it (lax.ragged_dot over all experts, tokens spread evenly) and a square
sweep that pins the device's ceiling independently of our shapes. bf16 inputs, fp32 accumulation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from benchmarks.systems import plots
from benchmarks.systems.report import table, write_json
from benchmarks.systems.saturation import saturation_point
from benchmarks.systems.sizes import power_ladder
from benchmarks.systems.timing import calls_for, device_memory_bytes, seconds_per_call

SATURATION_FRACTION = 0.9
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class GemmShape:
    name: str
    k: int
    n: int
    groups: int = 1  # > 1: grouped GEMM (ragged_dot) with M split evenly over this many experts

    def flops(self, m: int) -> float:
        return 2.0 * m * self.k * self.n

    def bytes(self, m: int) -> float:
        return 2.0 * (m * self.k + self.groups * self.k * self.n + m * self.n)


def model_shapes(cfg: ModelConfig) -> list[GemmShape]:
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    I, R, E = cfg.moe_intermediate_size, cfg.router_hidden_size, cfg.num_experts
    return [GemmShape("attn_q", D, H * d), GemmShape("attn_k", D, KV * d), GemmShape("attn_v_half", D, KV * d // 2),
            GemmShape("attn_o", H * d, D), GemmShape("router_down", D, R),
            GemmShape("expert_gate_up", D, 2 * I), GemmShape("expert_down", I, D),
            GemmShape("experts_gate_up_grouped", D, 2 * I, groups=E), GemmShape("lm_head", D, cfg.vocab_size)]


def _program(shape: GemmShape, m: int):
    ka, kb = jax.random.split(jax.random.key(m))
    a = jax.random.normal(ka, (m, shape.k), BF16)
    if shape.groups == 1:
        b = jax.random.normal(kb, (shape.k, shape.n), BF16)
        return jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(BF16)), (a, b)
    b = jax.random.normal(kb, (shape.groups, shape.k, shape.n), BF16)
    sizes = jnp.full((shape.groups,), m // shape.groups, jnp.int32)
    return (jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32).astype(BF16)),
            (a, b, sizes))


def measure(shape: GemmShape, m: int, target_s: float = 0.01) -> dict:
    fn, args = _program(shape, m)
    probe = seconds_per_call(fn, *args, reps=1, calls=1, warmup=1)
    t = seconds_per_call(fn, *args, reps=3, calls=calls_for(probe, target_s), warmup=0)
    return dict(shape=shape.name, m=m, k=shape.k, n=shape.n, groups=shape.groups, flops=shape.flops(m),
                seconds=t, tflops=shape.flops(m) / t / 1e12)


def _fits(shape: GemmShape, m: int, max_flops: float, device_bytes: int | None) -> bool:
    if shape.flops(m) > max_flops or m % shape.groups:
        return False
    return device_bytes is None or shape.bytes(m) < 0.4 * device_bytes


def sweep(cfg: ModelConfig, *, m_min: int = 256, m_max: int = 65536, m_step: int = 4, square_min: int = 256,
          square_max: int = 16384, max_flops: float = 1e13, target_s: float = 0.01, log=print) -> dict:
    device_bytes = device_memory_bytes()
    records = []
    for shape in model_shapes(cfg):
        rows = [measure(shape, m, target_s) for m in power_ladder(m_min, m_max, m_step)
                if _fits(shape, m, max_flops, device_bytes)]
        records += rows
        if rows:
            log(f"  {shape.name:>24}: {rows[-1]['tflops']:.1f} TFLOP/s at M={rows[-1]['m']}")
    for n in power_ladder(square_min, square_max, 2):
        sq = GemmShape("square", n, n)
        if _fits(sq, n, max_flops, device_bytes):
            records.append(measure(sq, n, target_s))
    best = max(r["tflops"] for r in records)
    per_shape = []
    for name in dict.fromkeys(r["shape"] for r in records):
        rows = sorted((r for r in records if r["shape"] == name), key=lambda r: r["flops"])
        reach = next((r for r in rows if r["tflops"] >= SATURATION_FRACTION * best), None)
        sat = saturation_point([r["flops"] for r in rows], [r["tflops"] for r in rows], SATURATION_FRACTION)
        per_shape.append(dict(shape=name, best_tflops=max(r["tflops"] for r in rows),
                              own_saturation_flops=sat.x,
                              reaches_90pct_of_best_at_flops=reach["flops"] if reach else None,
                              reaches_90pct_of_best_at_m=reach["m"] if reach else None))
    square = sorted((r for r in records if r["shape"] == "square"), key=lambda r: r["flops"])
    headline = saturation_point([r["flops"] for r in square], [r["tflops"] for r in square], SATURATION_FRACTION)
    return dict(model=_model_label(cfg), records=records, per_shape=per_shape, best_tflops=best,
                saturation_flops=headline.x, square_plateau_tflops=headline.plateau)


def _model_label(cfg: ModelConfig) -> dict:
    return dict(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                num_experts=cfg.num_experts, vocab_size=cfg.vocab_size)


def summary_table(result: dict) -> str:
    rows = [dict(s, sat=s["reaches_90pct_of_best_at_flops"] and s["reaches_90pct_of_best_at_flops"] / 1e9)
            for s in result["per_shape"]]
    return table(rows, [("shape", "shape", ""), ("best_tflops", "best TFLOP/s", ".1f"),
                        ("sat", "90% of device best at GFLOP", ".1f"), ("reaches_90pct_of_best_at_m", "at M", "")])


def plot(result: dict, path: str) -> str:
    series = []
    for name in dict.fromkeys(r["shape"] for r in result["records"]):
        rows = sorted((r for r in result["records"] if r["shape"] == name), key=lambda r: r["flops"])
        series.append(dict(label=name, x=[r["flops"] for r in rows], y=[r["tflops"] for r in rows]))
    marks = [dict(x=result["saturation_flops"], label="90% (square)")] if result["saturation_flops"] else []
    hl = [dict(y=SATURATION_FRACTION * result["best_tflops"], label="90% of best")]
    return plots.line_panels(path, [dict(title="bf16 GEMM", series=series, marks=marks, hlines=hl)],
                             xlabel="FLOPs per GEMM", ylabel="TFLOP/s", title="GEMM throughput vs size")


def run(cfg: ModelConfig, out_dir: str, log=print, **kw) -> dict:
    result = sweep(cfg, log=log, **kw)
    write_json(f"{out_dir}/gemm.json", result)
    plots.try_plot(plot, result, f"{out_dir}/gemm.png", log)
    log(summary_table(result))
    if result["saturation_flops"]:
        log(f"square GEMMs reach 90% of their plateau at {result['saturation_flops'] / 1e9:.1f} GFLOP; "
            f"best {result['best_tflops']:.1f} TFLOP/s")
    return result

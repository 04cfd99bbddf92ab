"""Data-parallel + ZeRO-1 weak scaling: the same per-device batch on 1, 2, 4, ... N devices; tokens/s per device
and the efficiency against one device (`dp_weak_scaling_efficiency_N` = per-device tokens/s on N / on 1).

Every device count's step is compiled first, all at once in threads, then each is run alone (state created,
warmed up, timed, freed) in increasing order, so the 1-device reference is always measured."""

from __future__ import annotations

import concurrent.futures as cf
import time

from zaya_jax.config import ModelConfig
from benchmarks.systems.scaling_step import (
    MeshStep,
    StepSpec,
    step_memory_gib,
    time_steps,
)


def run(cfg: ModelConfig, counts: list[int], *, seq_len: int, rows_per_device: int, warmup: int, steps: int,
        ce_chunk: int | None, deadline: float, save=lambda result: None, log=print) -> dict:
    result = {"model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "experts": cfg.num_experts,
                        "vocab": cfg.vocab_size, "dtype": cfg.dtype, "attention_impl": cfg.attention_impl,
                        "remat": cfg.remat},
              "seq_len": seq_len, "rows_per_device": rows_per_device, "warmup": warmup, "steps": steps,
              "optimizer": "Muon + AdamW, ZeRO-1 (whole-matrix Newton-Schulz)", "runs": []}
    steps_by_n = {n: MeshStep(StepSpec(cfg, seq_len, rows_per_device * n, n, ce_chunk=ce_chunk)) for n in counts}
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(len(counts)) as pool:
        compile_s = dict(zip(counts, pool.map(lambda n: steps_by_n[n].compile(), counts)))
    result["compile_wall_s"] = time.perf_counter() - t
    log(f"  compiled {counts} in {result['compile_wall_s']:.0f} s (each: "
        + ", ".join(f"{n}: {s:.0f} s" for n, s in compile_s.items()) + ")")
    for n in counts:
        if time.time() > deadline:
            result["stopped"] = f"time budget reached before {n} devices"
            break
        ms = steps_by_n[n]
        state = ms.init_state()
        state, step_s, loss = time_steps(ms, state, ms.batch(), warmup=warmup, steps=steps)
        tokens = ms.spec.tokens
        run_row = {"devices": n, "compile_s": compile_s[n], "step_s": step_s, "tokens_per_s": tokens / step_s,
                   "tokens_per_s_per_device": tokens / step_s / n, "loss": loss,
                   "step_memory_gib": step_memory_gib(ms)}
        del state
        result["runs"].append(run_row)
        base = result["runs"][0]
        if base["devices"] == 1:
            eff = run_row["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
            run_row["efficiency"] = eff
            result[f"dp_weak_scaling_efficiency_{n}"] = eff
        log(f"  DP x{n}: {step_s * 1e3:.1f} ms/step, {run_row['tokens_per_s_per_device']:.0f} tokens/s per device"
            + (f", efficiency {run_row['efficiency']:.3f}" if "efficiency" in run_row else ""))
        save(result)
    return result

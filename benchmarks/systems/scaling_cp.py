"""Context parallelism at long sequences: CP = 2, 4, ... N against a 1-device reference of the same model.

For each sequence length, a short run (the same random sequence, the same initial state) on one device and on CP
devices (mesh data=1 x context=CP, zigzag layout): the loss of every step and the reduced gradients of the first
and the last step are compared (relative L2 error over all parameters, and the worst single tensor), then a few
more steps are timed for tokens/s per device. The model keeps ZAYA1's attention shapes (CCA, 8 query / 2 KV heads
of 128) but few layers and a small vocabulary, so that one device holds the whole sequence."""

from __future__ import annotations

import concurrent.futures as cf
import time

import jax
import numpy as np

from zaya_jax.config import ModelConfig
from benchmarks.systems.scaling_step import (
    MeshStep,
    StepSpec,
    step_memory_gib,
    time_steps,
)


def grad_errors(ref, got) -> dict:
    """Relative L2 error of gradient trees (fp64 on the host): over all leaves together and the worst leaf."""
    total_diff = total_ref = 0.0
    worst, worst_name = 0.0, None
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        d, r = float(np.sum((a - b) ** 2)), float(np.sum(a ** 2))
        total_diff, total_ref = total_diff + d, total_ref + r
        rel = (d / r) ** 0.5 if r > 0 else (0.0 if d == 0 else float("inf"))
        if rel > worst:
            worst, worst_name = rel, jax.tree_util.keystr(path)
    return {"grad_rel_l2": (total_diff / max(total_ref, 1e-300)) ** 0.5, "worst_leaf_rel_l2": worst,
            "worst_leaf": worst_name}


def short_run(ms: MeshStep, steps: int) -> tuple[object, list[float], list]:
    """(state, loss per step, [host gradients after the first step, after the last])."""
    state, batch = ms.init_state(), ms.batch(seed=1)
    losses, grads = [], []
    for i in range(steps):
        state, metrics = ms.run(state, batch)
        losses.append(float(metrics["loss"]))
        if i in (0, steps - 1):
            grads.append(jax.device_get(state["opt_state"][0]))
    return state, losses, grads


def run(cfg: ModelConfig, lengths: list[int], cps: list[int], *, check_steps: int, warmup: int, steps: int,
        attention: str, deadline: float, tolerance: dict, save=lambda result: None, log=print) -> dict:
    result = {"model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "experts": cfg.num_experts,
                        "vocab": cfg.vocab_size, "dtype": cfg.dtype, "attention_impl": cfg.attention_impl,
                        "remat": cfg.remat},
              "context_attention": attention, "zero1": False, "check_steps": check_steps, "tolerance": tolerance, "runs": []}
    for seq in lengths:
        # the bias controller off: each context-parallel rank would balance its own part of the sequence
        # (docs/routing.md), which routes differently from one device by design
        specs = [StepSpec(cfg, seq, 1, 1, capture_grads=True, balancing=False)]
        # zero1=False: with data=1 the ZeRO-1 gradient layout over 'context' alone fails shard_map's varying-axes
        # check in parallel/data_parallel.py (gradients are all-reduced instead; the model math is the same)
        specs += [StepSpec(cfg, seq, 1, cp, context=cp, context_attention=attention, capture_grads=True,
                           zero1=False, balancing=False) for cp in cps]
        if time.time() > deadline:
            result["stopped"] = f"time budget reached before {seq} tokens"
            break
        built = [MeshStep(s) for s in specs]
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(len(built)) as pool:
            list(pool.map(lambda m: m.compile(), built))
        log(f"  {seq} tokens: compiled 1 + CP {cps} in {time.perf_counter() - t:.0f} s")
        ref, ref_losses, ref_grads = None, None, None
        for ms in built:
            if time.time() > deadline:
                result["stopped"] = f"time budget reached in the {seq}-token runs"
                break
            cp = ms.spec.context
            state, losses, grads = short_run(ms, check_steps)
            state, step_s, _ = time_steps(ms, state, ms.batch(seed=1), warmup=warmup, steps=steps)
            del state
            row = {"seq_len": seq, "cp": cp, "devices": ms.spec.devices, "compile_s": ms.compile_s,
                   "losses": losses, "step_s": step_s, "tokens_per_s": seq / step_s,
                   "tokens_per_s_per_device": seq / step_s / ms.spec.devices,
                   "step_memory_gib": step_memory_gib(ms)}
            if cp == 1:
                ref_losses, ref_grads = losses, grads
            else:
                row["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                row["first_step"] = grad_errors(ref_grads[0], grads[0])
                row["last_step"] = grad_errors(ref_grads[-1], grads[-1])
                row["equal"] = bool(row["loss_max_rel_diff"] <= tolerance["loss_rel"]
                                    and row["first_step"]["grad_rel_l2"] <= tolerance["grad_rel_l2"]
                                    and row["last_step"]["grad_rel_l2"] <= tolerance["grad_rel_l2"])
                row["efficiency_vs_1_device"] = row["tokens_per_s_per_device"] / ref["tokens_per_s_per_device"]
            if cp == 1:
                ref = row
            result["runs"].append(row)
            log(f"  {seq} tokens CP={cp}: {step_s * 1e3:.0f} ms/step, {row['tokens_per_s_per_device']:.0f} tokens/s "
                f"per device" + (f"; loss rel diff {row['loss_max_rel_diff']:.2e}, grads rel L2 "
                                 f"{row['first_step']['grad_rel_l2']:.2e} / {row['last_step']['grad_rel_l2']:.2e}"
                                 f" -> {'equal' if row['equal'] else 'DIFFERENT'}" if cp > 1 else ""))
            save(result)
        del built
    return result

"""The paper's sizing rules (spec sections 13 and 15) as a recommendation for a model, a context length and a
machine:
  1. pad the vocabulary to a multiple of 64;
  2. no tensor or expert parallelism unless HBM forces it ("minimal TP/EP"), and then a degree that spans a
     whole node (xGMI reaches full bandwidth only when every GPU of a node takes part); context parallelism, whose
     traffic is small, takes the smallest power of two that lets one sequence fit (2 at 32k for ZAYA1);
  3. the largest microbatch that fits HBM (memory_model), trimmed to divide the per-rank share of the global
     batch when one is given;
  4. data parallel over the rest with ZeRO-1; gradient bucket at the collective's bandwidth-saturation point;
  5. estimates: memory by part, compute time at the GEMM ceiling, ZeRO-1 communication per step, and whether the
     expert GEMMs are large enough to run at the ceiling (~200 GFLOP on MI300X).
"""

from __future__ import annotations

import dataclasses
import math

from zaya_jax.config import ModelConfig
from benchmarks.systems import memory_model as mm
from benchmarks.systems.hardware import HardwareSpec
from benchmarks.systems.sizes import human_bytes
from zaya_jax.train.flops import flops_per_token

VOCAB_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class Target:
    seq_len: int
    num_devices: int
    global_batch_tokens: int | None = None


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def _powers_of_two_upto(n: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(n)) + 1)] if n >= 1 else [1]


def candidate_layouts(hw: HardwareSpec):
    """(tp, ep, cp) in the order the rules prefer them: no model parallelism first, then EP, then TP, each a
    whole node; CP as small as possible inside a node."""
    node = hw.devices_per_node
    for tp, ep in ((1, 1), (1, node), (node, 1), (node, node)):
        for cp in _powers_of_two_upto(node // tp):
            yield tp, ep, cp


def recommend(cfg: ModelConfig, hw: HardwareSpec, target: Target, recipe: mm.Recipe = mm.PAPER,
              tokenizer_vocab: int | None = None) -> dict:
    vocab = tokenizer_vocab or cfg.vocab_size
    padded = padded_vocab(vocab)
    cfg = cfg.replace(vocab_size=padded) if padded != cfg.vocab_size else cfg
    for tp, ep, cp in candidate_layouts(hw):
        ranks_per_replica = tp * cp
        if target.num_devices % ranks_per_replica or (ep > 1 and (target.num_devices // ranks_per_replica) % ep):
            continue
        par = mm.Parallel(dp=target.num_devices // ranks_per_replica, tp=tp, ep=ep, cp=cp)
        fits = mm.largest_microbatch(cfg, recipe, par, target.seq_len, hw.hbm_bytes, hw.reserved_fraction)
        if fits >= 1:
            return _plan(cfg, hw, target, recipe, par, fits, vocab, padded)
    return dict(fits=False, reason=f"{cfg.num_hidden_layers}-layer model at {target.seq_len} tokens does not fit "
                                   f"{hw.hbm_bytes / 1e9:.0f} GB even with TP = EP = CP = {hw.devices_per_node}")


def _plan(cfg, hw, target, recipe, par, fits, vocab, padded) -> dict:
    per_rank = None
    microbatch, accumulation = fits, None
    if target.global_batch_tokens:
        per_rank = target.global_batch_tokens / (target.seq_len * par.dp)
        if per_rank >= 1 and per_rank == int(per_rank):
            per_rank = int(per_rank)
            microbatch = max(d for d in range(1, min(fits, per_rank) + 1) if per_rank % d == 0)
            accumulation = per_rank // microbatch
        else:
            accumulation = math.ceil(per_rank / fits)
    memory = mm.step_memory(cfg, recipe, par, target.seq_len, microbatch, hw.hbm_bytes, hw.reserved_fraction)
    bucket, bucket_source = hw.bucket_bytes()
    return dict(
        fits=True, recipe=recipe.name, hardware=hw.name,
        vocab=dict(tokenizer=vocab, padded=padded, pad_rows=padded - vocab),
        parallel=dict(dp=par.dp, tp=par.tp, ep=par.ep, cp=par.cp, zero1=recipe.zero1 and par.dp > 1),
        microbatch=dict(largest_that_fits=fits, chosen=microbatch, sequences_per_rank_per_step=per_rank,
                        accumulation_steps=accumulation),
        memory_bytes=memory, gradient_bucket=dict(bytes=bucket, source=bucket_source),
        estimates=_estimates(cfg, hw, target, recipe, par, microbatch, accumulation or 1))


def _estimates(cfg, hw, target, recipe, par, microbatch, accumulation) -> dict:
    tokens_micro = microbatch * target.seq_len / par.cp  # on one device
    step_tokens = tokens_micro * accumulation
    compute_s = step_tokens * flops_per_token(cfg, target.seq_len) / (par.tp * hw.gemm_flops)
    params = sum(mm.params_per_device(cfg, par).values())
    n = par.dp * par.cp
    # ZeRO-1: reduce-scatter the gradients, all-gather the updated weights, each moving (n-1)/n of the buffer
    comm_bytes = params * (recipe.grad_bytes + recipe.weight_bytes) * (n - 1) / n
    comm_s = comm_bytes / hw.inter_node_busbw if n > 1 else 0.0
    expert_gemm = 2.0 * tokens_micro * cfg.hidden_size * 2 * cfg.moe_intermediate_size
    per_expert = tokens_micro / cfg.num_experts
    return dict(tokens_per_device_per_microbatch=tokens_micro, compute_s_at_gemm_ceiling=compute_s,
                zero1_communication_s=comm_s, tokens_per_s_per_device_at_ceiling=step_tokens / compute_s,
                grouped_expert_gemm_flops=expert_gemm, tokens_per_expert=per_expert,
                expert_gemm_saturated=(None if hw.gemm_saturation_flops is None
                                       else expert_gemm >= hw.gemm_saturation_flops))


def describe(rec: dict) -> str:
    if not rec["fits"]:
        return rec["reason"]
    p, mb, v, est = rec["parallel"], rec["microbatch"], rec["vocab"], rec["estimates"]
    mem = rec["memory_bytes"]
    lines = [
        f"hardware {rec['hardware']}, recipe {rec['recipe']}",
        f"vocabulary: {v['tokenizer']} -> {v['padded']} (multiple of {VOCAB_MULTIPLE}, {v['pad_rows']} pad rows)",
        f"parallelism: DP {p['dp']}{' + ZeRO-1' if p['zero1'] else ''}, TP {p['tp']}, EP {p['ep']}, CP {p['cp']}",
        f"microbatch: {mb['chosen']} (largest that fits: {mb['largest_that_fits']}"
        + (f"; {mb['sequences_per_rank_per_step']} sequences per rank per step, {mb['accumulation_steps']} "
           f"micro-steps" if mb["sequences_per_rank_per_step"] else "") + ")",
        "memory per device (GB): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in mem.items()),
        f"gradient bucket: {human_bytes(rec['gradient_bucket']['bytes'])} ({rec['gradient_bucket']['source']})",
        (f"time per step at the GEMM ceiling: compute {est['compute_s_at_gemm_ceiling']:.2f} s, ZeRO-1 traffic "
         f"{est['zero1_communication_s']:.2f} s if not overlapped"),
        f"grouped expert GEMM: {est['grouped_expert_gemm_flops'] / 1e9:.0f} GFLOP per microbatch "
        f"({est['tokens_per_expert']:.0f} tokens per expert)"
        + ({True: ", above the saturation size", False: ", BELOW the saturation size: raise the microbatch",
            None: ""}[est["expert_gemm_saturated"]]),
    ]
    return "\n".join(lines)

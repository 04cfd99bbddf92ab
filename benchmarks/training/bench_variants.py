"""What the training benchmark measures: one `Variant` per compiled program, the issue's default set, opt-in
exploration variants, and the memory searches (32k context, largest 4k batch) whose candidates are tried in order
against XLA's memory analysis before anything runs."""

from __future__ import annotations

import dataclasses

KINDS = ("step", "fwd", "fwd_bwd", "opt", "accum")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    batch: int
    seq: int
    attention_impl: str = "cudnn"
    remat: str = "none"
    moe_impl: str = "ragged"
    norm_impl: str = "xla"
    ce_impl: str = "xla"
    conv_impl: str = "xla"
    ce_chunk: int | None = 8192  # None: full [B, T, V] logits (benchmarks.bench_train --ce-chunk sets every variant's)
    optimizer: str = "zaya"  # 'zaya' (Muon + AdamW, build_optimizer) | 'adamw' (AdamW on every parameter, like HF)
    kind: str = "step"  # see KINDS
    accum: int = 1  # kind 'accum': microbatches (each batch x seq) of one optimizer step, the trainer's program
    big: bool = False  # timed last, alone in memory (after the HF process has exited and other states are freed)
    search: str = ""  # name of the memory search this variant is a candidate of ('' = none)
    muon_gram_impl: str = "xla"
    scan_layers: bool = True
    cast_weights_once: bool = True  # kind 'accum': train.cast_weights_once (model/compute_view.py)
    per_layer_view: bool = True  # kind 'accum', unrolled layers: the view sliced per layer once per step
    grads_per_pass: int = 1  # kind 'accum': microbatch gradients added to the fp32 sum in one pass (train option)
    defer_expert_wgrad: bool = False  # kind 'accum': expert weight gradients formed once per pass (train option)
    moe_tiling: tuple[tuple[str, int], ...] = ()  # GroupedTiling fields replaced while tracing (moe_impl 'pallas')
    max_steps: int | None = None  # cap on timed calls (long programs)
    note: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"variant {self.name}: kind {self.kind!r} not one of {KINDS}")
        if self.accum < 1 or (self.kind != "accum" and self.accum != 1):
            raise ValueError(f"variant {self.name}: accum={self.accum} needs kind 'accum' and must be >= 1")

    @property
    def tokens(self) -> int:
        """Tokens one call of the program processes."""
        return self.accum * self.batch * self.seq

    @property
    def state_key(self) -> str:
        """Variants with the same key share one train state (threaded through them by donation)."""
        return self.optimizer  # the Gram kernel choice does not change Muon's state structure


@dataclasses.dataclass(frozen=True)
class Search:
    """Candidates tried in order by XLA's memory analysis (compiled, not run): 'first' keeps the first that fits
    (e.g. 32k context: no remat, then remat); 'largest' walks upward and keeps the last that fits, stopping at the
    first that does not (largest batch)."""
    name: str
    mode: str  # 'first' | 'largest'
    candidates: tuple[Variant, ...]

    def __post_init__(self):
        if self.mode not in ("first", "largest"):
            raise ValueError(f"search {self.name}: mode {self.mode!r} not 'first' or 'largest'")


def with_ce_chunk(v: Variant, chunk: int) -> Variant:
    """--ce-chunk: the head chunk of every variant that keeps the default one (a variant that names its own chunk, or
    full logits, is the other side of an A/B and keeps it)."""
    default = Variant.__dataclass_fields__["ce_chunk"].default
    return dataclasses.replace(v, ce_chunk=chunk) if v.ce_chunk == default else v


def context_name(seq: int) -> str:
    return f"ctx{seq // 1024}k" if seq % 1024 == 0 else f"ctx{seq}"


def main_variant(batch: int, seq: int, gpu: bool, cudnn: bool = False) -> Variant:
    """Our step as the trainer runs it on this platform. On the GPU: the Pallas attention, norms, cross-entropy, CCA
    q/k mixing, grouped-GEMM experts and Gram kernel, layers unrolled (fwd+bwd 83.7 ms against 103.9 under lax.scan on the H200,
    docs/experiments.md, model / config). On NVIDIA (`cudnn`) the attention is cuDNN's, the fastest there (the 16
    microbatch step 1245.7 against 1266.4 ms with the Pallas kernel, benchmarks/results/train_h200_accum16_ab.json); one
    device only, see train/loop.py. The CPU keeps XLA's ops and the scan: the Pallas kernels only run interpreted
    there, and a dry run should compile fast."""
    fast = "pallas" if gpu else "xla"
    return Variant("main", batch, seq, attention_impl="cudnn" if cudnn else fast, norm_impl=fast, ce_impl=fast,
                   conv_impl=fast, moe_impl="pallas" if gpu else "ragged",
                   muon_gram_impl=fast, scan_layers=not gpu,
                   note="our full step: chunked CE, no remat, Muon (symmetric Gram kernel) + AdamW, Pallas kernels"
                        + (", cuDNN attention" if cudnn else ""))


def default_variants(batch: int, seq: int, gpu: bool, long_seq: int, ladder: list[int], accums: list[int],
                     ladder_remat: str = "none", cudnn: bool = False) -> tuple[list[Variant], list[Search]]:
    """What the issue asks for, in priority order (compiled and timed in this order), and the memory searches."""
    main = main_variant(batch, seq, gpu, cudnn)
    r = dataclasses.replace
    vs = [
        main,
        r(main, name="fwd", kind="fwd", note="forward + loss only"),
        r(main, name="fwd_bwd", kind="fwd_bwd", note="forward + backward (gradients out), no update"),
        r(main, name="opt_zaya", kind="opt", note="Muon + AdamW update alone"),
        r(main, name="main_adamw", optimizer="adamw", note="main with AdamW on every parameter (HF's optimizer)"),
        r(main, name="opt_adamw", kind="opt", optimizer="adamw", note="AdamW update alone"),
        r(main, name="moe_ragged", moe_impl="ragged", note="main with lax.ragged_dot experts (XLA's dispatch)"),
    ]
    for k in accums:
        steps = max(2, 12 // k)  # a call is k microbatches long
        vs.append(r(main, name=f"accum{k}", kind="accum", accum=k, max_steps=steps, grads_per_pass=GRADS_PER_PASS,
                    defer_expert_wgrad=True,
                    note=f"one optimizer step of {k} microbatches of {batch}x{seq}, the trainer's program on one "
                         f"device (make_accumulating_train_step, train.grads_per_pass={GRADS_PER_PASS}): gradients "
                         f"summed in fp32 over a scan, {GRADS_PER_PASS} microbatches per pass, the expert weight "
                         "gradients of a pass formed after it, one Muon + AdamW update"))
    ctx = context_name(long_seq)
    if accums and (max(accums) * batch * seq) % long_seq == 0:
        # the long context through the trainer's accumulating program with as many tokens per update as the largest
        # 4k accumulation: the like-for-like comparison of tokens/s per context length (both updates amortised)
        k = max(accums) * batch * seq // long_seq
        vs.append(r(main, name=f"{ctx}_accum{k}", kind="accum", accum=k, batch=1, seq=long_seq, max_steps=2,
                    big=True, grads_per_pass=GRADS_PER_PASS, defer_expert_wgrad=True,
                    note=f"one optimizer step of {k} microbatches of 1x{long_seq} (as many tokens per update as "
                         f"accum{max(accums)}), the trainer's program"))
    searches = [
        Search(ctx, "first", tuple(
            r(main, name=ctx + ("" if remat == "none" else f"_remat_{remat}"), batch=1, seq=long_seq, remat=remat,
              big=True, search=ctx, max_steps=4, note=f"long context, batch 1, remat {remat}")
            for remat in ("none", "save_dots", "full"))),
        Search("largest_batch", "largest", tuple(
            r(main, name=f"batch{b}", batch=b, remat=ladder_remat, big=True, search="largest_batch", max_steps=4,
              note=f"main at batch {b}, remat {ladder_remat}") for b in ladder)),
    ]
    return vs, searches


# Microbatches per accumulation pass of the accum rows. 8 measured slower than 4 both without the expert gradients
# deferred (101.5k against 102.2k tokens/s at 16 microbatches, docs/experiments.md, training step) and with them
# (official runs of two calls: 64 microbatches 109.8k against 111.1k, peak 88.4 against 61.6 GiB;
# docs/experiments.md, training step).
GRADS_PER_PASS = 4

def extra_variants(batch: int, seq: int, gpu: bool, cudnn: bool = False) -> list[Variant]:
    """Exploration, opt-in by name (--variants): measured before, not part of the issue's figures."""
    main = main_variant(batch, seq, gpu, cudnn)
    r = dataclasses.replace
    fwd_bwd = r(main, name="fwd_bwd", kind="fwd_bwd")
    accum16 = r(main, name="accum16", kind="accum", accum=16, max_steps=2, grads_per_pass=GRADS_PER_PASS,
                defer_expert_wgrad=True)
    return [
        r(main, name="baseline", remat="full", ce_chunk=None, note="full logits, full remat"),
        r(main, name="full_ce", ce_chunk=None, note="main without the chunked CE"),
        r(main, name="remat_full", remat="full", note="main with full remat"),
        r(main, name="remat_save_dots", remat="save_dots", note="main, remat saving dots"),
        r(main, name="scan", scan_layers=True, note="main with the layers under lax.scan"),
        r(main, name="moe_dense", moe_impl="dense", note="every expert on every token (reference dispatch)"),
        r(main, name="opt_zaya_xla_gram", kind="opt", muon_gram_impl="xla", note="Muon with XLA's Gram products"),
        # forward + backward alone under one change each (the update does not depend on them)
        r(fwd_bwd, name="fwd_bwd_scan", scan_layers=True, note="fwd_bwd with the layers under lax.scan"),
        r(fwd_bwd, name="fwd_bwd_cudnn_attn", attention_impl="cudnn" if gpu else "xla",
          note="fwd_bwd with cuDNN's attention"),
        r(fwd_bwd, name="fwd_bwd_pallas_attn", attention_impl="pallas" if gpu else "xla",
          note="fwd_bwd with the Pallas flash attention"),
        r(fwd_bwd, name="fwd_bwd_xla_norm", norm_impl="xla", note="fwd_bwd with XLA's norms"),
        r(fwd_bwd, name="fwd_bwd_xla_ce", ce_impl="xla", note="fwd_bwd with XLA's softmax cross-entropy"),
        r(fwd_bwd, name="fwd_bwd_ce4096", ce_chunk=4096, note="fwd_bwd, CE chunks of 4096 tokens"),
        r(fwd_bwd, name="fwd_bwd_xla_conv", conv_impl="xla",
          note="fwd_bwd with XLA's CCA q/k mixing (both convolutions, mean residual paths)"),
        # accum16 under one change each (accum16 itself: cast once, per-layer view, 4 gradients per pass)
        r(accum16, name="accum16_cast_per_micro", cast_weights_once=False,
          note="accum16 with the weights cast to bf16 in every microbatch (no compute_view)"),
        r(accum16, name="accum16_stacked_view", per_layer_view=False,
          note="accum16 with the view stacked: the layer weights sliced in every microbatch, their gradients "
               "restacked"),
        *(r(accum16, name=f"accum16_grads_per_pass{m}", grads_per_pass=m,
            note=f"accum16 with the gradients of {m} microbatch(es) added to the fp32 sum in one pass")
          for m in (1, 2, 4, 8) if m != GRADS_PER_PASS),
        r(accum16, name="accum16_no_defer", defer_expert_wgrad=False,
          note="accum16 with each microbatch's expert weight gradients in bf16, added to the fp32 sum per pass (no "
               "deferral, model/deferred_wgrad.py)"),
        r(accum16, name="accum16_cudnn_attn", attention_impl="cudnn" if gpu else "xla",
          note="accum16 with cuDNN's attention"),
        r(accum16, name="accum16_pallas_attn", attention_impl="pallas" if gpu else "xla",
          note="accum16 with the Pallas flash attention"),
        r(accum16, name="accum16_xla_conv", conv_impl="xla",
          note="accum16 with XLA's CCA q/k mixing (both convolutions, mean residual paths)"),
        r(accum16, name="accum16_ce4096", ce_chunk=4096, note="accum16, CE chunks of 4096 tokens"),
        *(r(v, name=f"{v.name}_moe_units128", moe_tiling=(("block_rows", 128),),
            note=f"{v.name} with each expert's rows padded to whole 128-row grouped-GEMM tiles (no short last tile)")
          for v in (fwd_bwd, accum16)),
    ]


def select(variants: list[Variant], searches: list[Search], extras: list[Variant], want: str, skip: str):
    """--variants / --skip (comma lists of variant or search names). An unknown name is an error that lists the
    known ones."""
    known = {v.name for v in variants + extras} | {s.name for s in searches}
    known |= {c.name for s in searches for c in s.candidates}
    asked = [x for x in want.split(",") if x]
    dropped = {x for x in skip.split(",") if x}
    unknown = sorted(set(asked) - known) + sorted(dropped - known)
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; known: {sorted(known)}")
    if asked:
        chosen = [v for v in variants + extras if v.name in asked]
        searches = [s if s.name in asked else dataclasses.replace(
            s, candidates=tuple(c for c in s.candidates if c.name in asked)) for s in searches]
    else:
        chosen = list(variants)
    chosen = [v for v in chosen if v.name not in dropped]
    searches = [dataclasses.replace(s, candidates=tuple(c for c in s.candidates if c.name not in dropped))
                for s in searches if s.name not in dropped]
    return chosen, [s for s in searches if s.candidates]

"""Which kernel implementations the inference programs run: ModelConfig overrides per program and platform.

Programs (each compiled with its own static config; the parameters are shared):
  'scoring'  Scorer: whole right-padded rows, positions 0..T-1, no mask (ops dispatch on the model's impls).
  'prefill'  Decoder prefill: a chunk of left-padded prompts over the cache (slot positions, kv_valid).
  'decode'   Decoder step / generation loop: one token per row over the cache.

kernels (the `kernels=` option of Scorer, Decoder, ZayaLM and the launch scripts):
  None     the model's own config, unchanged.
  'xla'    the ModelConfig defaults: XLA attention ([B, H, T, S] scores), lax.ragged_dot experts, XLA norms/convs.
  'gpu'    the Pallas (Triton) kernels training runs on GPU (attention, grouped-GEMM experts, norms, CCA convs) for
           scoring and prefill, whose token counts are the training step's. Decode keeps XLA's attention (the flash
           kernel would pad one query per row to a 16-row tile) but takes the norm and CCA convolution kernels: a
           single-token step is a chain of small kernels, and each of those is one launch where XLA emits two to
           four (a reduction, then the normalisation; the halo concatenation, the grouped GEMM, the residual add).
           On the CPU the Pallas kernels run in interpret mode (tests).
  'auto'   'gpu' on a GPU backend, 'xla' elsewhere (Pallas has no CPU or TPU lowering here); on NVIDIA GPUs the
           scoring program's attention is cuDNN's fused causal kernel (faster than the Pallas one at lm-eval row
           lengths, docs/experiments.md) when every layer's window is static (not a mix of sliding and full layers).
Decode's experts are moe_impl 'decode' under every choice but None (model/experts.py: each token's own expert
weights, or every expert read once, instead of a grouped GEMM whose XLA lowering copies and transposes the layer's
expert weights every step; benchmarks/profile_decode.py measures where a decode step's time goes).
cuDNN attention is chosen for scoring only: jax's cuDNN path takes no traced sliding window (mixed layer types) and
the cache programs would need a dense [B, T, S] mask; scoring's whole rows need neither.
"""

from __future__ import annotations

import jax
from flax import nnx

from zaya_jax.config import ModelConfig

KERNELS = ("auto", "xla", "gpu")
PROGRAMS = ("scoring", "prefill", "decode")

XLA = dict(attention_impl="xla", moe_impl="ragged", norm_impl="xla", conv_impl="xla")
GPU = dict(attention_impl="pallas", moe_impl="pallas", norm_impl="pallas", conv_impl="pallas")


def inference_kernels(platform: str, program: str = "scoring", *, static_windows: bool = True) -> dict:
    """ModelConfig overrides for `program` on `platform` ('gpu', 'cuda', 'rocm' get the Pallas kernels, anything
    else the XLA defaults; 'cuda' scores with cuDNN attention where every layer's window is static)."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown inference program {program!r}; known: {PROGRAMS}")
    gpu = platform in ("gpu", "cuda", "rocm")
    if program == "decode":
        return dict(XLA, moe_impl="decode", **(dict(norm_impl="pallas", conv_impl="pallas") if gpu else {}))
    if program == "scoring" and platform == "cuda" and static_windows:
        return dict(GPU, attention_impl="cudnn")
    return dict(GPU) if gpu else dict(XLA)


def kernel_overrides(kernels: str | None, program: str, cfg: ModelConfig | None = None) -> dict:
    """The overrides that `kernels` (None, 'auto', 'xla' or 'gpu') means for `program` here (for a model of `cfg`:
    whether its layers' windows are static)."""
    if kernels is None:
        return {}
    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} unknown; use one of {KERNELS} (or None: the model's config)")
    platform = _vendor() if kernels == "auto" else {"xla": "cpu", "gpu": "gpu"}[kernels]
    return inference_kernels(platform, program, static_windows=cfg is None or static_windows(cfg))


def _vendor() -> str:
    """'cpu', 'cuda' or 'rocm' for the default backend ('tpu' and others as jax names them)."""
    if jax.default_backend() != "gpu":
        return jax.default_backend()
    from pallas_kernels.platform import vendor
    return vendor()


def static_windows(cfg: ModelConfig) -> bool:
    """Every layer's attention window is a Python int or None (all layers full, or all sliding): not a per-layer
    value traced from the layer index."""
    return len(set(cfg.layer_types)) == 1


def with_config(model, cfg: ModelConfig):
    """The same model (its parameter arrays shared, not copied) with `cfg` in every module that holds one."""
    if cfg == model.cfg:
        return model
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(clone):
        if isinstance(getattr(module, "cfg", None), ModelConfig):
            module.cfg = cfg
    return clone


def with_kernels(model, kernels: str | None, program: str):
    """`model` running `program` with the implementations `kernels` picks (see the module docstring)."""
    overrides = kernel_overrides(kernels, program, model.cfg)
    return with_config(model, model.cfg.replace(**overrides)) if overrides else model

"""Flax NNX modules of ZAYA1. Parameter names follow the Hugging Face checkpoint keys (per-layer leaves are
stacked along a leading layer axis), so zaya_jax.checkpoint.hf is a rename, a stack and nothing more."""

from zaya_jax.model.zaya import ZayaForCausalLM, ZayaModel, ForwardAux

__all__ = ["ZayaForCausalLM", "ZayaModel", "ForwardAux"]

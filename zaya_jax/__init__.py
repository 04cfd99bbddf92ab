"""zaya-jax: a JAX/Flax (NNX) reimplementation of the ZAYA1 training stack.

    model = zaya_jax.from_hf("path/to/hf_dir", dtype=jnp.float32)   # ZayaForCausalLM; model(ids, mask) -> logits
    zaya_jax.to_hf(model, "path/to/out_dir")                         # loadable by transformers' ZayaForCausalLM

The checkpoint functions import lazily so that `zaya_jax.config` stays cheap to import (configs are data).
"""

_LAZY = {
    "from_hf": "zaya_jax.checkpoint.hf",
    "to_hf": "zaya_jax.checkpoint.hf",
    "ZayaCheckpointError": "zaya_jax.checkpoint.errors",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zaya_jax' has no attribute {name!r}")


__all__ = sorted(_LAZY)

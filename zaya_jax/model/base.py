"""Small building blocks shared by every ZAYA1 module: HF-oriented linear layers, RMSNorm weights, residual
scaling, the balancing-bias variable, dtype helpers and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig


class BalancingBias(nnx.Variable):
    """Router balancing biases: model state that the optimizer never touches (updated by the PID controller)."""


def compute_matmul(spec: str, a, b):
    """einsum whose result stays in the operands' (compute) dtype; the GEMM still accumulates in fp32. An fp32
    result would make the backward's cotangent fp32 and turn both backward GEMMs into fp32 ones (measured on the
    H200: 24% of the bench step)."""
    return jnp.einsum(spec, a, b, preferred_element_type=a.dtype)


def dtypes(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)


def normal_init(cfg: ModelConfig):
    return nnx.initializers.normal(cfg.initializer_range)


class Linear(nnx.Module):
    """y = x W^T (+ b) with W stored [out, in] as in PyTorch / the HF checkpoint."""

    def __init__(self, cfg: ModelConfig, d_in: int, d_out: int, *, bias: bool, rngs: nnx.Rngs):
        _, pdt = dtypes(cfg)
        self.weight = nnx.Param(normal_init(cfg)(rngs.params(), (d_out, d_in), pdt))
        self.bias = nnx.Param(jnp.zeros((d_out,), pdt)) if bias else None

    def __call__(self, x, dtype=None):
        dtype = dtype or x.dtype
        y = compute_matmul("...i,oi->...o", x.astype(dtype), self.weight[...].astype(dtype))
        if self.bias is not None:
            y = (y.astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(dtype)
        return y


class RMSNormWeight(nnx.Module):
    def __init__(self, cfg: ModelConfig, dim: int):
        self.weight = nnx.Param(jnp.ones((dim,), dtypes(cfg)[1]))


class ResidualScaling(nnx.Module):
    """(branch + hidden_states_bias) * hidden_states_scale + (residual + residual_bias) * residual_scale."""

    def __init__(self, cfg: ModelConfig):
        _, pdt = dtypes(cfg)
        D = cfg.hidden_size
        self.hidden_states_scale = nnx.Param(jnp.ones((D,), pdt))
        self.hidden_states_bias = nnx.Param(jnp.zeros((D,), pdt))
        self.residual_scale = nnx.Param(jnp.ones((D,), pdt))
        self.residual_bias = nnx.Param(jnp.zeros((D,), pdt))

    def vectors(self):
        return (self.hidden_states_scale[...], self.hidden_states_bias[...], self.residual_scale[...],
                self.residual_bias[...])


def activation(name: str):
    return {
        "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    }[name]

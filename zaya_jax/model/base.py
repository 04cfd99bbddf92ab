"""Small building blocks shared by every ZAYA1 module: HF-oriented linear layers, RMSNorm weights, residual
scaling, the balancing-bias variable, dtype helpers and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from zaya_jax.config import ModelConfig


class BalancingBias(nnx.Variable):
    """Router balancing biases: model state that the optimizer never touches (updated by the PID controller)."""


def compute_matmul(spec: str, a, b):
    """einsum whose result stays in the operands' (compute) dtype; the GEMM still accumulates in fp32. An fp32
    result would make the backward's cotangent fp32 and turn both backward GEMMs into fp32 ones (a large share of
    the bench step on the H200, docs/experiments.md)."""
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


@jax.custom_jvp
def gelu_exact(x):
    """x/2 erfc(-x/sqrt(2)): jax.nn.gelu(approximate=False)'s operations, with its own derivative. jax 0.12's erfc
    JVP evaluates lax.polynomial on constant coefficients that lack the varying manual axes of a shard_map body,
    which the vma check rejects; this derivative is jax 0.11.2's erfc rule, d erfc(z) = -2/sqrt(pi) exp(-z^2) dz,
    in the order autodiff applies it (the same gradients, bit for bit, as jax.nn.gelu on 0.11.2)."""
    return 0.5 * x * lax.erfc(-x * np.sqrt(0.5).astype(x.dtype))


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    c = np.sqrt(0.5).astype(x.dtype)
    z = -x * c
    erfc_z = lax.erfc(z)
    d_erfc = np.asarray(-2.0 / np.sqrt(np.pi), x.dtype) * ((-dx * c) * jnp.exp(-lax.square(z)))
    half_x = 0.5 * x
    return half_x * erfc_z, (0.5 * dx) * erfc_z + half_x * d_erfc


def activation(name: str):
    return {
        "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
        "gelu": gelu_exact,
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    }[name]

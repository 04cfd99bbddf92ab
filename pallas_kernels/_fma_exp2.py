"""2^x for x <= 0 on the FMA pipes: a cubic polynomial and an exponent-field add, no special-function unit.

A flash-attention tile computes one exponential per logit, and a GPU's special-function unit (MUFU) issues them at a
fraction of the FMA pipes' rate (16 against 128 per clock per SM on Hopper), so evaluating part of a tile's
exponentials as a polynomial spreads the work over both units (FlashAttention-4's trick). Built from plain jnp ops
(the Triton lowering has no inline assembly here, and none is allowed): round x to the nearest integer n with the
1.5 * 2^23 shifter (no float-to-int conversion, which runs on the same slow unit), 2^(x - n) by a near-minimax
cubic on [-1/2, 1/2] (relative error <= 7.5e-5, far below bf16's 3.9e-3 spacing), and n added to the exponent
field. Inputs below EXP2_FMA_MIN give about 2^-125, not 0, so masked or underflowing logits contribute about
1e-38. Used only for bf16/fp16 attention: fp32 kernels keep the exact exp2 (their tests ask for 1e-5).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

EXP2_FMA_MIN = -125.0  # keeps n + the polynomial's exponent a normal float's exponent
_SHIFTER = 12582912.0  # 1.5 * 2^23: x + shifter rounds x to an integer held in the low mantissa bits
# 2^f ~ c0 + c1 f + c2 f^2 + c3 f^3 on [-1/2, 1/2], fitted for relative error (Lawson-weighted least squares)
_C = (0.9999280727914275, 0.6932609870111996, 0.24261113509452606, 0.055171666814688686)


def exp2_fma(x):
    """2^x for fp32 x <= 0 (relative error <= 7.5e-5; about 2^-125 for x <= -125)."""
    # The clamps sit between the shifter's add and subtract: XLA (interpret mode) folds (x + s) - s to x.
    shifted = jnp.maximum(x + _SHIFTER, _SHIFTER + EXP2_FMA_MIN)  # the integer n = round(x) in the low bits
    f = jnp.maximum(x - (shifted - _SHIFTER), -0.5)  # x - n, in [-1/2, 1/2]
    p = _C[0] + f * (_C[1] + f * (_C[2] + f * _C[3]))
    n_bits = lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), 23)  # n << 23, two's complement
    return lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + n_bits, jnp.float32)


def exp2_parts(block: int, fma_fraction: float, dtype) -> list[tuple[int, int, object]]:
    """A key tile of `block` keys as (offset, size, exp2 function) parts: the first part's exponentials on the
    special-function unit, the rest as `exp2_fma`. fma_fraction 0 keeps one exact part, 1 one FMA part, 0.5 two
    halves; fp32 tiles split the same way but stay exact."""
    if fma_fraction not in (0, 0.5, 1):
        raise ValueError(f"fma_exp fraction must be 0, 0.5 or 1, got {fma_fraction}")
    fma = exp2_fma if jnp.dtype(dtype).itemsize < 4 else jnp.exp2
    if fma_fraction == 0:
        return [(0, block, jnp.exp2)]
    if fma_fraction == 1:
        return [(0, block, fma)]
    if block < 32:
        raise ValueError(f"splitting a {block}-key tile leaves halves below 16 keys, the smallest Triton dot")
    return [(0, block // 2, jnp.exp2), (block // 2, block // 2, fma)]

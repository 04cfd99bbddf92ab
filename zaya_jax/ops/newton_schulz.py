"""Newton-Schulz orthogonalisation, the core of Muon: the pure-jnp reference and the dispatch of its two
symmetric products to the Pallas kernel.

For each matrix X (m x n, leading dims are batch dims, every matrix is handled on its own):
    X0 = X / (||X||_F + eps)                                  (fp32, then cast to the iteration dtype)
    repeat `steps` times:  A = X Xᵀ;  B = a I + b A + c A·A;  X = B X
with (a, b, c) = (3.4445, -4.7750, 2.0315). If m > n the iteration runs on Xᵀ so that the Gram matrix A is the
small side (min(m, n)²) and the result is transposed back. The quintic does not converge to U Vᵀ exactly: it maps
each singular value s of X0 through the same scalar polynomial; after 5 steps every s >= 2e-3 lands in
[0.68, 1.21].

(a X + (b A + c A·A) X written as one product: the a X term rides in B's diagonal, so the last product is a plain
GEMM that writes X in the iteration dtype, with no fp32 [m, n] intermediate and no elementwise pass after it.
In bf16 it is also a little more accurate than adding a X afterwards: 1.0% vs 1.2% from float64 after 5 steps
on 1024x2048 and 2048x1024 matrices.)

Precision: products accumulate in fp32 and are stored in the iteration dtype (bf16 by default), the linear
combination is formed in fp32 and stored in the iteration dtype. The Pallas path computes A and A·A on the
upper-triangle tiles only and forms a I + b A + c A·A in the kernel's epilogue from the fp32 accumulator (one
rounding of A·A fewer); otherwise only the fp32 summation order differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

QUINTIC_COEFFS = (3.4445, -4.7750, 2.0315)
GRAM_IMPLS = ("xla", "pallas")


def _precision(dtype):
    # fp32 iterations must not silently run in TF32 on GPUs.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def gram_reference(x):
    """X Xᵀ over the last two dims, fp32 accumulation, stored in x.dtype."""
    return jnp.einsum("...ik,...jk->...ij", x, x, precision=_precision(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def gram(x, impl: str = "xla", tiling=None):
    """X Xᵀ by `impl`; `tiling` (a pallas_kernels.symmetric_matmul.GramTiling) tunes the Pallas kernel."""
    if impl == "xla":
        return gram_reference(x)
    if impl == "pallas":
        from pallas_kernels import symmetric_matmul
        return symmetric_matmul.symmetric_gram(x, tiling=tiling)
    raise ValueError(f"gram: unknown impl {impl!r}; use one of {GRAM_IMPLS}")


def quintic_matrix(A, coeffs=QUINTIC_COEFFS, impl: str = "xla", tiling=None):
    """a I + b A + c A·A for a symmetric A (A·A = A Aᵀ), stored in A.dtype."""
    a, b, c = coeffs
    if impl == "pallas":  # one kernel: c A Aᵀ on the upper tiles, + b A + a I in the epilogue
        from pallas_kernels import symmetric_matmul
        return symmetric_matmul.symmetric_gram(A, A, alpha=float(c), beta=float(b), diag=float(a), tiling=tiling)
    f32 = jnp.float32
    eye = jnp.eye(A.shape[-1], dtype=f32)
    return (a * eye + b * A.astype(f32) + c * gram(A, impl, tiling).astype(f32)).astype(A.dtype)


def quintic_combination(A, b, c, impl: str = "xla", tiling=None):
    """b A + c A·A for a symmetric A, stored in A.dtype (the quintic matrix without its a I)."""
    return quintic_matrix(A, (0.0, b, c), impl, tiling)


def apply_left(B, x):
    """B X in x.dtype with fp32 accumulation. GPUs accumulate bf16 GEMMs in fp32 and write bf16 directly (no fp32
    [m, n] intermediate, no convert pass); XLA:CPU's bf16-out dot loses precision (2.4% vs 1.0% from float64 after
    5 NS steps on 2048x1024), so there the product is formed in fp32 and rounded once."""
    out = jnp.float32 if jax.default_backend() == "cpu" else x.dtype
    return jnp.einsum("...ij,...jn->...in", B, x, precision=_precision(x.dtype),
                      preferred_element_type=out).astype(x.dtype)


def newton_schulz_step(x, coeffs=QUINTIC_COEFFS, gram_impl: str = "xla", tiling=None):
    """One quintic step on x [..., m, n] with m <= n (the Gram side), in x.dtype."""
    A = gram(x, gram_impl, tiling)
    return apply_left(quintic_matrix(A, coeffs, gram_impl, tiling), x)


def newton_schulz_step_unfolded(x, coeffs=QUINTIC_COEFFS):
    """The step as usually written, a X + (b A + c A·A) X, in XLA: the benchmark's baseline of the earlier code."""
    a, b, c = coeffs
    f32 = jnp.float32
    B = quintic_combination(gram_reference(x), b, c)
    BX = jnp.einsum("...ij,...jn->...in", B, x, precision=_precision(x.dtype), preferred_element_type=f32)
    return (a * x.astype(f32) + BX).astype(x.dtype)


def newton_schulz(x, *, steps: int = 5, coeffs=QUINTIC_COEFFS, dtype=jnp.bfloat16, eps: float = 1e-7,
                  gram_impl: str = "xla", tiling=None):
    """Orthogonalise every matrix of x [..., m, n]; returns [..., m, n] in `dtype`."""
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices (ndim >= 2), got shape {x.shape}")
    if not isinstance(steps, int):
        raise TypeError(f"newton_schulz: steps must be a Python int (the loop is unrolled), got {type(steps)}")
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = jnp.swapaxes(x, -1, -2)
    xf = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(xf * xf, axis=(-2, -1), keepdims=True))
    x = (xf / (norm + eps)).astype(dtype)
    for _ in range(steps):
        x = newton_schulz_step(x, coeffs, gram_impl, tiling)
    return jnp.swapaxes(x, -1, -2) if transpose else x


__all__ = [
    "GRAM_IMPLS",
    "QUINTIC_COEFFS",
    "apply_left",
    "gram",
    "gram_reference",
    "newton_schulz",
    "newton_schulz_step",
    "newton_schulz_step_unfolded",
    "quintic_combination",
    "quintic_matrix",
]

"""Dropless top-1 SwiGLU experts. gate_up_proj [E, 2I, D] (rows [0, I) gate, [I, 2I) up), down_proj [E, D, I].

'ragged': tokens sorted by expert, two grouped GEMMs through lax.ragged_dot_general (contracting the stored [out,
in] weights directly), unsorted by a gather. 'pallas': a layout where every expert's rows fill whole row tiles, two
grouped GEMM kernels (pallas_kernels.grouped_matmul; XLA lowers ragged_dot on GPU to a dense dot over all experts),
the first reading the tokens' rows into the layout as it loads them, the result gathered back. 'dense': every expert
on every token, a one-hot select (the reference the tests pin the others against). 'decode' (a decode step's few
tokens): at most E / 2 tokens gather their own expert's weights and apply them alone; up to DENSE_DECODE_TOKENS run
'dense', which reads each weight once in its stored layout and stays bound by those bytes rather than by its E-fold
products (a GPU does a few hundred bf16 products per byte it reads); more run 'ragged'. In a decode step the grouped
paths cost more than the weights' bytes: XLA copies the layer's slice of the stacked weights and transposes the down
projection before its grouped GEMM, every step. A token routed to the skip class (index E) gets a zero output, as in
the Hugging Face reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.base import activation, compute_matmul, dtypes, normal_init
from zaya_jax.ops import grouped_matmul as gmm

DENSE_DECODE_TOKENS = 256
_DN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                        rhs_group_dimensions=[0])


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        pdt = dtypes(cfg)[1]
        init = normal_init(cfg)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (E, 2 * I, D), pdt))
        self.down_proj = nnx.Param(init(rngs.params(), (E, D, I), pdt))

    def __call__(self, x, index, weight):
        """x [N, D] (compute dtype), index [N] in [0, E] (E = skip), weight [N] fp32 -> [N, D]."""
        cfg = self.cfg
        return expert_block(x, index, weight, _in_dtype(self.gate_up_proj, x.dtype), _in_dtype(self.down_proj, x.dtype),
                            activation(cfg.hidden_act), impl=cfg.moe_impl)


def _in_dtype(param, dtype):
    """The weight in the compute dtype; a DeferredWgrad (the accumulating step's view) is already in it."""
    w = param.get_value()
    return w if isinstance(w, gmm.DeferredWgrad) else w.astype(dtype)


def expert_block(x, index, weight, w_gu, w_down, act, *, impl: str, tiling=None):
    """The experts' output for x [N, D], index [N] (>= E: skip, zero output), routing weight [N]; weights in the
    compute dtype. `tiling` (moe_impl 'pallas' only) overrides the kernels' default GroupedTiling (benchmarks)."""
    E = w_gu.shape[0]
    skip = index >= E
    index = jnp.where(skip, E, index)
    weight = jnp.where(skip, 0.0, weight).astype(x.dtype)
    if impl == "pallas":
        out = _pallas(x, index, w_gu, w_down, act, tiling)
    elif isinstance(w_gu, gmm.DeferredWgrad) or isinstance(w_down, gmm.DeferredWgrad):
        raise ValueError(f"deferred expert weight gradients need moe_impl 'pallas' (a tile layout), not {impl!r}")
    elif impl == "decode" and x.shape[0] <= E // 2:
        out = _per_token(x, jnp.minimum(index, E - 1), w_gu, w_down, act)
    elif impl == "dense" or impl == "decode" and x.shape[0] <= DENSE_DECODE_TOKENS:
        out = _dense(x, index, w_gu, w_down, act)
    elif impl in ("ragged", "decode"):
        out = _ragged(x, index, w_gu, w_down, act)
    else:
        raise ValueError(f"moe_impl {impl!r} unknown (use 'ragged', 'pallas', 'dense' or 'decode')")
    return jnp.where(skip[:, None], 0, out * weight[:, None])


def _swiglu(gu, act):
    gate, up = jnp.split(gu, 2, axis=-1)
    return act(gate) * up


def _ragged(x, index, w_gu, w_down, act):
    E = w_gu.shape[0]
    order = jnp.argsort(index, stable=True)  # skip tokens (index E) sort last, outside every group
    sizes = jnp.bincount(index, length=E + 1)[:E].astype(jnp.int32)
    xs = x[order]
    gu = jax.lax.ragged_dot_general(xs, w_gu, sizes, _DN, preferred_element_type=x.dtype)  # see compute_matmul
    h = _swiglu(gu, act)
    out = jax.lax.ragged_dot_general(h, w_down, sizes, _DN, preferred_element_type=x.dtype)
    return out[jnp.argsort(order)]


def _per_token(x, index, w_gu, w_down, act):
    gu = compute_matmul("nd,nod->no", x, w_gu[index])
    return compute_matmul("ni,ndi->nd", _swiglu(gu, act), w_down[index])


def _pallas(x, index, w_gu, w_down, act, tiling):
    layout = gmm.tile_layout(index, w_gu.shape[0], gmm.block_rows(x.dtype, tiling=tiling))
    # the tokens' rows read in place by the first GEMM (padding rows are zeros)
    gu = gmm.grouped_matmul(x, w_gu, layout.tile_group, impl="pallas", tiling=tiling, layout=layout)
    out = gmm.grouped_matmul(_swiglu(gu, act), w_down, layout.tile_group, impl="pallas", tiling=tiling)
    return gmm.gather_rows(out, layout.dst, layout.src)  # skip tokens read zeros


def _dense(x, index, w_gu, w_down, act):
    E = w_gu.shape[0]
    gu = compute_matmul("nd,eod->eno", x, w_gu)
    out = compute_matmul("eni,edi->end", _swiglu(gu, act), w_down)
    onehot = jax.nn.one_hot(index, E, dtype=x.dtype)  # skip tokens: all-zero row
    return jnp.einsum("end,ne->nd", out, onehot)

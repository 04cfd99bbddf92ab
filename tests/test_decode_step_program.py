"""The decode step's program casts no layer weight for a kernel or a matmul: such a cast is a pass of its own (XLA
fuses a convert into an elementwise consumer, not into a Pallas kernel or a library GEMM), the same work at every
generated token, and XLA hoists no size-inflating op (a bf16 -> fp32 convert) out of the generation loop. The
inference view (model/compute_view.py) holds the routers' parameters in fp32, and the CCA convolution kernels cast
theirs as they read them. Checked on the jaxpr (the program before XLA) of a bf16 model's step with the kernels a
GPU runs (traced, not run: on the CPU they would run in interpret mode)."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal, jaxprs_in_params

from zaya_jax.config import preset
from zaya_jax.inference.decoder import Decoder, _step
from zaya_jax.model.compute_view import LAYERS, key_path
from zaya_jax.model.zaya import ZayaForCausalLM

CONSUMERS = ("pallas_call", "dot_general")  # what a convert cannot be fused into


def cast_weights_consumed(jaxpr, weights: dict) -> list[str]:
    """The layer weights that reach a kernel or a matmul through a convert. weights: {jaxpr var: (path of the layer
    weight it is computed from alone, whether a convert is on the way)}, extended as the walk goes (into nested
    jaxprs, not into kernels)."""
    found = []
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not isinstance(v, Literal)]
        if e.primitive.name in CONSUMERS:
            found += [weights[v][0] for v in ins if v in weights and weights[v][1]]
            continue
        if ins and all(v in weights for v in ins):
            cast = any(weights[v][1] for v in ins) or (e.primitive.name == "convert_element_type"
                                                        and bool(e.invars[0].aval.shape))
            weights.update((v, (weights[ins[0]][0], cast)) for v in e.outvars)
        for sub in jaxprs_in_params(e.params):
            if len(sub.invars) == len(e.invars):
                inner = {iv: weights[ov] for iv, ov in zip(sub.invars, e.invars)
                         if not isinstance(ov, Literal) and ov in weights}
                found += cast_weights_consumed(sub, inner)
    return found


def test_the_gpu_decode_step_casts_no_layer_weight_for_a_kernel_or_matmul():
    cfg = preset("tiny").replace(dtype="bfloat16", param_dtype="bfloat16", attention_bias=True)
    decoder = Decoder(ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)), kernels="gpu")
    cache = decoder.init_cache(1, 16)
    closed = jax.make_jaxpr(functools.partial(_step, decoder.step_graphdef))(decoder.state, cache,
                                                                              jnp.zeros((1,), jnp.int32))
    leaves = jax.tree_util.tree_flatten_with_path(decoder.state)[0]
    weights = {var: ("/".join(key_path(path)), False) for var, (path, _) in zip(closed.jaxpr.invars, leaves)
               if key_path(path)[:2] == LAYERS}
    assert weights
    assert cast_weights_consumed(closed.jaxpr, weights) == []


def test_the_gpu_decode_step_writes_each_layers_conv_ring_in_place():
    """Every layer's CCA convolution kernel takes the cache's ring as an input aliased to its ring output: the
    token's column is written into the carried buffer (an ordered halo cost a concatenation, a slice and a copy into
    the loop's carry at every token)."""
    cfg = preset("tiny").replace(dtype="bfloat16", param_dtype="bfloat16")
    decoder = Decoder(ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)), kernels="gpu")
    cache = decoder.init_cache(1, 16)
    closed = jax.make_jaxpr(functools.partial(_step, decoder.step_graphdef))(decoder.state, cache,
                                                                              jnp.zeros((1,), jnp.int32))
    rings = {v for v, leaf in zip(closed.jaxpr.invars, jax.tree.leaves((decoder.state, cache)))
             if any(leaf is r for r in jax.tree.leaves(cache.cca.conv))}

    def conv_calls(jaxpr, names):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call" and e.params.get("name") == "cca_qk_mix_fwd":
                yield e, names
            for sub in jaxprs_in_params(e.params):
                if len(sub.invars) == len(e.invars):
                    yield from conv_calls(sub, {iv for iv, ov in zip(sub.invars, e.invars)
                                                if not isinstance(ov, Literal) and ov in names})

    calls = list(conv_calls(closed.jaxpr, rings))
    assert len(calls) == cfg.num_hidden_layers
    for e, names in calls:
        aliased = [e.invars[i] for i, o in e.params["input_output_aliases"] if o == 1]
        assert len(aliased) == 1 and not isinstance(aliased[0], Literal) and aliased[0] in names

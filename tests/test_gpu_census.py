"""benchmarks/gpu_census.py's reading of an optimized program: the kernels of one decode-loop iteration, and the
per-layer split from two depths. Checked on this backend's own compile of a tiny decode loop (the GPU target needs
the CUDA plugin): one more layer adds the same positive number of kernels, and the tables add up."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.gpu_census import census, loop_kernels
from zaya_jax.config import preset
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.generate import _decode_loop
from zaya_jax.inference.sampling import GREEDY
from zaya_jax.model.zaya import ZayaForCausalLM


def kernels_at(layers: int):
    cfg = preset("tiny", num_hidden_layers=layers, dtype="bfloat16", param_dtype="bfloat16")
    decoder = Decoder(ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)), kernels="xla")
    loop = jax.jit(functools.partial(_decode_loop, decoder.step_graphdef), static_argnames=("sampling", "steps"))
    hlo = loop.lower(decoder.state, decoder.init_cache(1, 32), jnp.zeros((1, cfg.vocab_size)), jax.random.key(0),
                     jnp.asarray([-1], jnp.int32), jnp.int32(0), jnp.int32(8), sampling=GREEDY,
                     steps=8).compile().as_text()
    return loop_kernels(hlo)


def test_one_more_layer_adds_the_same_kernels():
    k1, k2, k3 = (kernels_at(n) for n in (2, 3, 4))
    assert len(k2) - len(k1) == len(k3) - len(k2) > 0
    report = census({2: k1, 4: k3}, depth=5)
    assert report["kernels_per_layer"] == len(k2) - len(k1)
    assert report["kernels_per_token"] == len(k1) + 3 * report["kernels_per_layer"]
    for table in ("per_layer_by_kind", "per_layer_by_op"):
        assert sum(report[table].values()) == report["kernels_per_layer"]
    assert any(kind.startswith("fusion") for kind in report["per_layer_by_kind"])

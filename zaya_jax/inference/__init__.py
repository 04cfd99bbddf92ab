"""Inference: the decode cache, prefill/step, generation and log-likelihood scoring."""

from zaya_jax.inference.cache import DecodeCache, KVCache, init_cache
from zaya_jax.inference.decoder import Decoder, extend
from zaya_jax.inference.generate import Generation, generate, generate_padded, left_pad, length_bucket
from zaya_jax.inference.sampling import GREEDY, Sampling

__all__ = ["GREEDY", "DecodeCache", "Decoder", "Generation", "KVCache", "Sampling", "extend", "generate",
           "generate_padded", "init_cache", "left_pad", "length_bucket"]

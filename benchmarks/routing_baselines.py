"""Routings that replace the router's choice of expert at no balancing cost (run them with
balancing.learning_rate 0, so that nothing solves): baselines that separate what the controller costs a step from
what routing to every expert costs (benchmarks/routing_ab.py, benchmarks/profile_routing.py).
  round_robin  token i of each forward to expert i mod E: equal groups (with E dividing the forward's tokens, whole
               row tiles of the grouped GEMM: no padding)
  collapsed    every token to expert 0: the workload of a collapsed router (routing_ab's collapsed runs put each
               layer's every token on one expert), one group of whole row tiles
  random       each token to an expert drawn from the low bits of its router probabilities (new draws in every
               forward and layer): groups that differ by sampling noise, padded to row tiles as the controller's are
The fixed routings add a value known only at run time (always 0) to their index: with a constant index XLA folds
the grouped GEMM's tile layout into the program, a baseline cheaper than any routing computed from the data
(docs/experiments.md, the whole-step profile)."""

import jax
import jax.numpy as jnp

from zaya_jax.model import router

ROUTINGS = ("round_robin", "collapsed", "random")


def replace_routing(routing: str) -> None:
    """Patches model/router.py's Router for the rest of the process."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} unknown; use one of {ROUTINGS}")
    routed = router.Router.__call__

    def replaced(self, x, prev_state, state_scale, token_mask=None):
        weight, index, u, probs, correction, moved = routed(self, x, prev_state, state_scale, token_mask)
        E = self.cfg.num_experts
        zero = (jax.lax.stop_gradient(probs).ravel()[0] < 0).astype(index.dtype)  # probabilities are >= 0
        if routing == "round_robin":
            index = ((jnp.arange(index.size, dtype=index.dtype) + zero) % E).reshape(index.shape)
        elif routing == "collapsed":
            index = jnp.broadcast_to(zero, index.shape)
        else:  # the low mantissa bits of a probability: uniform over the experts, different in every forward
            bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(probs[..., 0]), jnp.uint32)
            index = (bits % E).astype(index.dtype)
        weight = jnp.take_along_axis(probs, index[..., None], axis=-1)[..., 0]
        return weight, index, u, probs, correction, moved

    router.Router.__call__ = replaced

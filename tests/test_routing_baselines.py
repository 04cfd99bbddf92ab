"""benchmarks/routing_baselines.py: the fixed routings send tokens where they say, with an index the compiler cannot
fold into a constant (a constant one let XLA precompute the grouped GEMM's tile layout, an unfairly cheap baseline)."""

import jax
import jax.numpy as jnp
from jax.extend.core import Var
import numpy as np
import pytest
from flax import nnx

from benchmarks.routing_baselines import replace_routing
from zaya_jax.config import tiny
from zaya_jax.model.router import Router


@pytest.mark.parametrize("routing", ["round_robin", "collapsed"])
def test_fixed_routings_route_as_named_from_a_run_time_value(routing):
    cfg = tiny()
    restore = Router.__call__
    try:
        replace_routing(routing)
        router = Router(cfg, nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_size))
        prev = jnp.zeros((2, 8, cfg.router_hidden_size))
        scale = jnp.ones((cfg.router_hidden_size,))
        weight, index, _, probs, _, _ = router(x, prev, scale)
        jaxpr = jax.make_jaxpr(lambda x: router(x, prev, scale)[1])(x).jaxpr
    finally:
        Router.__call__ = restore
    want = np.arange(16).reshape(2, 8) % cfg.num_experts if routing == "round_robin" else np.zeros((2, 8))
    np.testing.assert_array_equal(np.asarray(index), want)
    np.testing.assert_allclose(weight, np.take_along_axis(np.asarray(probs), np.asarray(index)[..., None], -1)[..., 0])
    assert _depends_on_input(jaxpr)  # not a constant the compiler could fold


def _depends_on_input(jaxpr) -> bool:
    """Whether the jaxpr's first output is computed from its first input."""
    needed = {v for v in jaxpr.outvars[:1] if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if needed & set(eqn.outvars):
            needed |= {v for v in eqn.invars if isinstance(v, Var)}
    return jaxpr.invars[0] in needed


def test_unknown_routing_is_named():
    with pytest.raises(ValueError, match="unknown"):
        replace_routing("sideways")

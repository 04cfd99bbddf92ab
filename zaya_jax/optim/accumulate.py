"""Gradient accumulation that runs the inner optimizer once per k microbatches.

optax.MultiSteps (0.2.8) evaluates the inner update on every microbatch and throws it away with a select until the
k-th; with Muon that is the whole Newton-Schulz (~88 TFLOP on the bench model) on every microbatch. Here the inner
update sits in the branch of a lax.cond that only the k-th microbatch takes. The state is optax.MultiStepsState
and the accumulator is the same running mean (fp32), so results and checkpoints equal MultiSteps'.

The cond carries only what its branches change (the updates and the inner state, which the untaken branch returns
as is and XLA then aliases in place); the accumulator's reset is a select fused into the running-mean pass outside
it. Passing the accumulator through the cond made XLA copy it (a state-sized copy on every microbatch):
tests/test_accumulate_hlo.py checks the compiled step for that."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def every_k(inner: optax.GradientTransformation, every_k_schedule: int | Callable) -> optax.GradientTransformation:
    """Mean of k micro-gradients, then one inner update; zero updates in between. `every_k_schedule`: k, or a
    function of the optimizer step returning k (a batch-size ramp)."""
    schedule = every_k_schedule if callable(every_k_schedule) else (lambda step: every_k_schedule)

    def init(params):
        return optax.MultiStepsState(mini_step=jnp.zeros([], jnp.int32), gradient_step=jnp.zeros([], jnp.int32),
                                     inner_opt_state=inner.init(params),
                                     acc_grads=optax.tree.zeros_like(params, dtype=jnp.float32), skip_state=())

    def update(updates, state, params=None):
        k = schedule(state.gradient_step)
        n = state.mini_step
        acc = jax.tree.map(lambda g, a: a + (g - a) / (n + 1), updates, state.acc_grads)  # Welford mean
        emit = n == k - 1
        shapes = jax.eval_shape(lambda a, s, p: inner.update(optax.tree.cast_like(a, updates), s, p)[0],
                                acc, state.inner_opt_state, params)

        def apply(acc, inner_state):
            return inner.update(optax.tree.cast_like(acc, updates), inner_state, params)

        def hold(acc, inner_state):
            return optax.tree.zeros_like(shapes), inner_state

        out, inner_state = jax.lax.cond(emit, apply, hold, acc, state.inner_opt_state)
        acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)  # reset after the k-th
        step = jnp.where(emit, optax.safe_increment(state.gradient_step), state.gradient_step)
        return out, optax.MultiStepsState(mini_step=optax.safe_increment(n) % k, gradient_step=step,
                                          inner_opt_state=inner_state, acc_grads=acc, skip_state=state.skip_state)

    return optax.GradientTransformation(init, update)

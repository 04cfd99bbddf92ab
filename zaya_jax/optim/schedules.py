"""Learning-rate schedules as jit-safe functions of the step: warmup-stable-decay (linear or 1-sqrt cooldown) and
warmup + cosine. Both start at `init_value`, ramp linearly to `peak_value` over `warmup_steps`, and end at
`end_value` at `total_steps` (held there afterwards)."""

from __future__ import annotations

import jax.numpy as jnp
import optax

COOLDOWNS = ("linear", "1-sqrt")


def _check(warmup_steps: int, total_steps: int):
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps})")


def cooldown_steps(total_steps: int, decay_fraction: float) -> int:
    """warmup_stable_decay's default cooldown length: decay_fraction of the schedule, rounded."""
    return round(decay_fraction * total_steps)


def _warmup(step, init_value, peak_value, warmup_steps):
    frac = jnp.clip(step / max(warmup_steps, 1), 0.0, 1.0)
    return init_value + (peak_value - init_value) * frac


def warmup_stable_decay(peak_value: float, warmup_steps: int, total_steps: int, *, decay_steps: int | None = None,
                        decay_fraction: float = 0.2, cooldown: str = "linear", init_value: float = 0.0,
                        end_value: float = 0.0) -> optax.Schedule:
    """Warmup, a constant plateau at peak, then a cooldown over the last `decay_steps` (default: decay_fraction of
    total_steps). 'linear' falls linearly; '1-sqrt' follows peak - (peak - end) * sqrt(progress), which holds the
    rate high for longer and drops it fast at the very end."""
    _check(warmup_steps, total_steps)
    if cooldown not in COOLDOWNS:
        raise ValueError(f"cooldown must be one of {COOLDOWNS}, got {cooldown!r}")
    decay_steps = cooldown_steps(total_steps, decay_fraction) if decay_steps is None else decay_steps
    if not 0 <= decay_steps <= total_steps - warmup_steps:
        raise ValueError(f"decay_steps ({decay_steps}) must fit after warmup: <= {total_steps - warmup_steps}")
    decay_start = total_steps - decay_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((step - decay_start) / max(decay_steps, 1), 0.0, 1.0)
        shape = progress if cooldown == "linear" else jnp.sqrt(progress)
        cooled = peak_value - (peak_value - end_value) * shape
        return jnp.where(step < warmup_steps, _warmup(step, init_value, peak_value, warmup_steps), cooled)

    return schedule


def warmup_cosine(peak_value: float, warmup_steps: int, total_steps: int, *, init_value: float = 0.0,
                  end_value: float = 0.0) -> optax.Schedule:
    """Linear warmup, then a half cosine from peak to end over the remaining steps."""
    _check(warmup_steps, total_steps)
    decay_steps = total_steps - warmup_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((step - warmup_steps) / max(decay_steps, 1), 0.0, 1.0)
        cosine = end_value + (peak_value - end_value) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, _warmup(step, init_value, peak_value, warmup_steps), cosine)

    return schedule


__all__ = ["COOLDOWNS", "cooldown_steps", "warmup_stable_decay", "warmup_cosine"]

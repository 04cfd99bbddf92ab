"""Where CCA's two causal convolutions read in the padded input xp [B, T + P, C]: the halo P before t = 0 and the
column offset of each (grouped tap, depthwise tap) pair. Pure Python, shared by the jnp reference
(zaya_jax/ops/cca_conv.py) and the Pallas kernels (pallas_kernels/cca_conv.py)."""


def halo(t0: int, t1: int) -> int:
    """Columns before t = 0 that the two convolutions read (P)."""
    return (t0 - 1) + (t1 - 1)


def tap_offset(j: int, i: int, t0: int, t1: int) -> int:
    """Columns back from output t that depthwise tap i feeding grouped tap j reads."""
    return (t1 - 1 - j) + (t0 - 1 - i)

"""Errors raised while reading or writing checkpoints."""


class ZayaCheckpointError(ValueError):
    """A checkpoint that cannot be read into (or written from) a ZAYA model; the message names the problem."""

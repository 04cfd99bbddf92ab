"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """Data that cannot be used as asked: a missing, truncated or corrupt file, a dtype or vocabulary mismatch,
    an iterator state from another data configuration. The message names the file (or source) and the problem."""

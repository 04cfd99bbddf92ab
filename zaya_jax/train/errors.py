"""The trainer's configuration error: a config, command line or run directory that cannot work, reported in one line
(launch.train exits with it as a user error). A ConfigError, like the model config's."""

from zaya_jax.config import ConfigError


class TrainConfigError(ConfigError):
    pass

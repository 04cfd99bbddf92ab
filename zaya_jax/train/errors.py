"""The trainer's configuration error: a config, command line or run directory that cannot work, reported in one line
(launch.train exits with it as a user error)."""


class TrainConfigError(ValueError):
    pass

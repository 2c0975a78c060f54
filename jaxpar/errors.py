"""Errors jaxpar raises: bad configuration (before anything is compiled), and a training run
that cannot go on."""


class ConfigError(ValueError):
    """A configuration value that cannot work: the message names the field, the value and what would."""


class TrainingStopped(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient under train.on_nonfinite=stop):
    the message names the step and what went wrong."""

"""The one error type bad configuration raises, before anything is compiled."""


class ConfigError(ValueError):
    """A configuration value that cannot work: the message names the field, the value and what would."""

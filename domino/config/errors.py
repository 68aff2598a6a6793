"""The one error type of configuration problems."""


class ConfigError(ValueError):
    """A setting (or a combination of settings) that cannot work; the message names the flags."""

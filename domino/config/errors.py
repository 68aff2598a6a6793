"""The one error type of configuration checks (its own module so that every checker can raise it)."""


class ConfigError(ValueError):
    """A setting (or a combination of settings) that cannot work; the message names the flags."""

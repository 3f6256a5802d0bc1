"""The error a user's configuration mistake raises (its own module, so extension rules can raise it too)."""


class ConfigError(ValueError):
    """A user's configuration mistake: the CLI prints its one-line message and exits 2."""

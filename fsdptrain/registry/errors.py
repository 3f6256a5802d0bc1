"""The error a user's configuration mistake raises, and the one-line summary of an exception's message."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration mistake: the CLI prints its one-line message and exits 2."""


def first_line(err: BaseException | str) -> str:
    """The first line of an exception's message (or of a text), stripped of surrounding blank space.

    An exception with an empty message gives its type name (so a summary never reads as empty); an empty text gives
    the empty string.
    """
    text = str(err).strip()
    if text:
        return text.splitlines()[0]
    return type(err).__name__ if isinstance(err, BaseException) else ""

"""The error a user's configuration mistake raises, and the one-line summary of an exception's message."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration mistake: the CLI prints its one-line message and exits 2."""


OUTPUT_NOT_WRITTEN_EXIT = 3
"""Exit code of a command whose own work ended but an output the user named (``--json``, ``--out``) could not be
written: not 1 (a failed check or run) and not 2 (a usage error found before the work)."""


class OutputNotWritten(OSError):
    """An output the user named on the command line could not be written: its option, its path and the reason."""

    def __init__(self, option: str, path: str, err: OSError):
        super().__init__(err.errno, err.strerror)
        self.option, self.path = option, str(path)

    def __str__(self) -> str:
        return (f"{self.option} {self.path} could not be written ({self.strerror}): free some space or choose another "
                f"{self.option} path; the results are the lines printed above (exit code {OUTPUT_NOT_WRITTEN_EXIT}, "
                f"README.md, \"Exit codes\")")


def first_line(err: BaseException | str) -> str:
    """The first line of an exception's message (or of a text), stripped of surrounding blank space.

    An exception with an empty message gives its type name (so a summary never reads as empty); an empty text gives
    the empty string.
    """
    text = str(err).strip()
    if text:
        return text.splitlines()[0]
    return type(err).__name__ if isinstance(err, BaseException) else ""

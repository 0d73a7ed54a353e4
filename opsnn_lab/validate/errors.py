"""Errors for bad input to ``opsnn_lab.validate``: each message names the file, line or parameter."""

from __future__ import annotations


class ValidationInputError(ValueError):
    """The notebook, its expectations or the parameters cannot be used (nothing was executed)."""


class ExpectationsError(ValidationInputError):
    """An expectations file is malformed; the message starts with ``path:line:``."""

    def __init__(self, path, message: str, line: int | None = None):
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class NotebookInputError(ValidationInputError):
    """A notebook is missing, unreadable, or was given a parameter it does not define."""

"""One exception family, so the CLI can print any of them as one line and exit 2."""

from __future__ import annotations


class TokenBatchError(Exception):
    """Base class: bad input or configuration, reported without a traceback by the CLI."""


class TraceError(TokenBatchError, ValueError):
    """A trace file or array is invalid; names the file, row and column where known."""

    def __init__(self, message: str, *, file: str | None = None, row: int | None = None,
                 column: str | None = None):
        self.file, self.row, self.column, self.reason = file, row, column, message
        where = []
        if file is not None:
            where.append(str(file))
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{': '.join([', '.join(where)] if where else [])}{': ' if where else ''}{message}")


class ConfigError(TokenBatchError, ValueError):
    """A configuration value is invalid (names the field and what is valid)."""


class ProfileError(TokenBatchError, ValueError):
    """An engine profile is unknown, malformed or rejected by its fit-quality gate."""


class PolicyError(TokenBatchError, ValueError):
    """A policy is unknown, has bad parameters, or produced a NaN score."""


class OutputError(TokenBatchError, OSError):
    """An output file or directory cannot be written (names the path and the system's reason)."""

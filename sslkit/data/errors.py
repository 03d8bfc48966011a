"""The data layer's two errors: a source that cannot be built, and one sample that cannot be read."""

from __future__ import annotations

from sslkit.errors import UserError

__all__ = ["DataSourceError", "UnreadableSampleError"]


class DataSourceError(UserError, RuntimeError):
    """A data source cannot be built: data missing, unreadable, or empty."""


class UnreadableSampleError(Exception):
    """One sample cannot be decoded (corrupt or truncated file); ``path`` names the file."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

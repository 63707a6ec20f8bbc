"""Errors a user can act on: each is one line naming the key, file, row or item and what to do.

The CLI prints a ``UserError`` as that one line and exits with code 2, without a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DataError", "NothingToLearnError", "UserCodeError", "UserError"]


class UserError(ValueError):
    """A mistake in what the user gave (config, files, code); its message is one line."""


class ConfigError(UserError):
    """A config key or value the schema does not accept."""


class DataError(UserError):
    """A data file or row that cannot be used (names the file and row)."""


class UserCodeError(UserError):
    """User code named by the config (``file.py:name``) that is missing or has the wrong shape."""


class NothingToLearnError(UserError):
    """The run cannot produce a learning signal as configured (e.g. no group's scores vary)."""

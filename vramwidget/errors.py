"""The one exception type users see: a clear, one-line message naming what is wrong."""

from __future__ import annotations


class VramError(ValueError):
    """Bad input to vramwidget: the message names the field and what is allowed.

    It subclasses ValueError so callers that catch ValueError keep working.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnknownPresetError(VramError, KeyError):
    """A preset name that is not in the catalogue (the message lists close matches)."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return self.args[0]

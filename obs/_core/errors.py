"""One errors module with a shallow hierarchy; every error carries what it is about."""

from __future__ import annotations

from typing import Any

__all__ = ["ObsError", "ObsConfigError", "ObsConfigTypeError", "DeviceUnavailableError", "DamagedFileError",
           "NotOurFileError", "UnsafePathError", "shorten"]


class ObsError(Exception):
    """Base class of every error obs raises on purpose."""


class ObsConfigError(ObsError, ValueError):
    """An option, config file key or environment variable has a value obs cannot accept.

    ``option`` names the key, ``value`` is what was given, ``source`` where it came from
    (``set_context``, a file path, an environment variable).
    """

    def __init__(self, message: str, *, option: str = "", value: Any = None, source: str = "") -> None:
        super().__init__(message)
        self.option = option
        self.value = value
        self.source = source


class ObsConfigTypeError(ObsError, TypeError):
    """An option got a value of the wrong type."""

    def __init__(self, message: str, *, option: str = "", value: Any = None, source: str = "") -> None:
        super().__init__(message)
        self.option = option
        self.value = value
        self.source = source


class DeviceUnavailableError(ObsConfigError):
    """The requested ``device_target`` / ``device_id`` does not exist in this process."""


def shorten(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, so a huge value never floods a message."""
    text = value if isinstance(value, str) and value.startswith(("'", '"')) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit - 20]}…[{len(text)} chars]"


class DamagedFileError(ObsError, ValueError):
    """A file obs wrote is damaged (torn, corrupt, truncated): names the file and the byte offset.

    The CLI exits 1 on it (a check found a problem).
    """

    def __init__(self, message: str, *, path: str = "", offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


class NotOurFileError(ObsError, ValueError):
    """The input is not a file of the expected kind at all (a text file given as a print file).

    The CLI exits 2 on it (bad input).
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class UnsafePathError(ObsError, PermissionError):
    """A path obs refuses to write through or read from: a symlink where none may be, a file that is not
    regular or not ours, a folder other users can write to."""

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path

"""One errors module with a shallow hierarchy; every error carries what it is about."""

from __future__ import annotations

from typing import Any

__all__ = ["ObsError", "ObsConfigError", "ObsConfigTypeError", "DeviceUnavailableError"]


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

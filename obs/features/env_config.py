"""The applier of ``env_config_path``: the settings of the file in force, hot reload, step-boundary swaps.

A hot reload is validated on the watcher's thread and *staged*; it takes effect at the next step
boundary, on the training thread (``tracker.at_boundary``), where nothing is mid-event: the
recorder is swapped there, never under a running handler, and signals are never touched from the
watcher thread.  While a file is watched, steps are detected (a step demand) so the boundary comes.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from obs._core.errors import ObsConfigError
from obs._core.events import Event, bus
from obs.runtime.steps import StepDemand, tracker
from obs.settings._watch import FileWatcher
from obs.settings.env_config_file import EnvConfig, load_file, resolve

__all__ = ["EnvConfigFeature", "ObsConfigWarning", "env_config", "feature"]

logger = logging.getLogger("obs")


class ObsConfigWarning(UserWarning):
    """A reloaded config file was invalid; the last good settings stay in force."""


class EnvConfigFeature:
    """Holds the :class:`EnvConfig` in force and the watcher of its file."""

    keys = frozenset({"env_config_path"})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: EnvConfig | None = None
        self._pending: EnvConfig | None = None
        self._staged = threading.Condition(self._lock)
        self._watcher: FileWatcher | None = None
        self._demand: StepDemand | None = None
        self.last_error: str | None = None  #: the error of the last invalid reload, None after a good one
        self.debounce_s = 0.2
        self.listeners: list[Any] = []  #: called with no argument after the settings in force changed

    # -- state -------------------------------------------------------------------------------
    def current(self) -> EnvConfig:
        with self._lock:
            if self._current is None:
                self._current = resolve(None, os.environ)
            return self._current

    @property
    def watcher(self) -> FileWatcher | None:
        return self._watcher

    # -- applier protocol --------------------------------------------------------------------
    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> EnvConfig:
        path = values.get("env_config_path", "")
        return resolve(load_file(path) if path else None, os.environ)

    def commit(self, prepared: EnvConfig, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        self._stop()
        self._swap(prepared, "set_context")
        if prepared.file:
            self._watcher = FileWatcher(prepared.file, self._reload, debounce_s=self.debounce_s).start()
            self._demand = tracker.require("config hot reload")
            tracker.at_boundary.add(self.apply_pending)

    def close(self) -> None:
        self._stop()
        with self._lock:
            self._current = self._pending = None
            self.last_error = None

    # -- hot reload --------------------------------------------------------------------------
    def _reload(self) -> None:
        watcher = self._watcher
        if watcher is None:
            return
        try:
            cfg = resolve(load_file(watcher.path), os.environ)
        except ObsConfigError as exc:
            message = f"{exc}; keeping the settings in force"
            if message != self.last_error:
                self.last_error = message
                logger.warning("%s", message)
                warnings.warn(message, ObsConfigWarning, stacklevel=1)
            return
        self.last_error = None
        with self._lock:
            self._pending = cfg  # applied at the next step boundary, on the training thread
            self._staged.notify_all()

    def staged(self) -> EnvConfig | None:
        """The validated reload waiting for the next step boundary, if any."""
        with self._lock:
            return self._pending

    def wait_staged(self, predicate: Any, timeout: float) -> EnvConfig | None:
        """Block until the staged reload satisfies ``predicate(cfg)``; None on timeout (tests use it)."""
        with self._lock:
            if self._staged.wait_for(lambda: self._pending is not None and predicate(self._pending), timeout):
                return self._pending
            return None

    def apply_pending(self) -> None:
        """Apply the staged reload now: called between steps on the training thread."""
        if self._pending is None:  # every step boundary: no lock unless a reload is staged (seen next time)
            return
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._swap(pending, pending.file, reload=True)

    def _swap(self, cfg: EnvConfig, source: str, *, reload: bool = False) -> None:
        with self._lock:
            old, self._current = self._current, cfg
        if old is None:
            old = resolve(None, {})
        changes = {f"{section}.{key}": (old.values[section][key], value)
                   for section, keys in cfg.values.items() for key, value in keys.items()
                   if old.values[section][key] != value}
        if changes:
            bus.emit(Event.SETTINGS_CHANGED, source, changes)
            for listener in self.listeners:
                try:
                    listener()
                except (OSError, ValueError) as exc:  # e.g. a reloaded rdr.path that cannot be created
                    if not reload:
                        raise  # set_context: its caller rolls back and reports
                    message = f"{source}: applying the reloaded settings failed: {exc}"
                    self.last_error = message
                    logger.warning("%s", message)
                    warnings.warn(message, ObsConfigWarning, stacklevel=1)

    def _stop(self) -> None:
        tracker.at_boundary.remove(self.apply_pending)
        if self._demand is not None:
            self._demand.remove()
            self._demand = None
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        with self._lock:
            self._pending = None


feature = EnvConfigFeature()


def env_config() -> dict[str, dict[str, Any]]:
    """The env-config settings in force (file, after any reload, over ``MS_RDR_*``) as plain data."""
    return feature.current().as_dict()

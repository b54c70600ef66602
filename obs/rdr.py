"""The Running Data Recorder, wired to the settings: ``env_config_path`` rdr section, ``MS_RDR_*``, op_timeout.

``obs.rdr.dump(reason)`` writes a bundle now; ``obs.rdr.recorder()`` is the live recorder (or None);
``obs.rdr.recover(path)`` turns the rings of dead processes into bundles.  The recorder follows
the settings in force: set_context, hot reloads of the file, reset_context (which closes it
without dumping).  ``recorder`` is imported lazily so ``import obs`` stays light.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from obs._core.errors import ObsError
from obs.settings import _env_feature
from obs.settings._context import get_context, snapshot
from obs.settings.parallel import rank, world_size

if TYPE_CHECKING:
    from recorder.recorder import RdrConfig, Recorder
    from recorder.triggers import Triggers

__all__ = ["RdrFeature", "dump", "feature", "recorder", "recover", "start_from_environment"]

_RUN_ID = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]


def _versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    from obs import __version__

    torch = sys.modules.get("torch")
    try:
        torch_version = torch.__version__ if torch is not None else metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {"obs": __version__, "python": platform.python_version(), "torch": str(torch_version)}


def _settings() -> dict[str, Any]:
    return {"context": {k: v for k, v in snapshot().items()}, "env_config": _env_feature.env_config()}


class RdrFeature:
    """Starts, reconfigures and stops the recorder to match the settings in force."""

    keys = frozenset({"env_config_path", "op_timeout"})

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.recorder: Recorder | None = None
        self.triggers: Triggers | None = None
        _env_feature.feature.listeners.append(self.sync)

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        return None  # the env config file is checked by its own applier, which runs first

    def commit(self, prepared: None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        self.sync()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def desired(self) -> RdrConfig | None:
        rdr = _env_feature.env_config()["rdr"]
        if not rdr["enable"]:
            return None
        from recorder.layout import DEFAULT_CAPACITY
        from recorder.recorder import RdrConfig

        return RdrConfig(path=rdr["path"], mode=rdr["mode"], granularity=rdr["granularity"],
                         capacity={**DEFAULT_CAPACITY, **rdr["capacity"]}, op_timeout=get_context("op_timeout"),
                         hang_action=rdr["hang_action"])

    def sync(self) -> None:
        """Bring the recorder in line with the settings (start, restart on a new layout, or stop)."""
        with self._lock:
            want = self.desired()
            have = self.recorder.config if self.recorder is not None else None
            if want == have:
                return
            if want is not None and have is not None and (want.path, want.granularity, want.capacity) == \
                    (have.path, have.granularity, have.capacity):
                self._retune(want)
                return
            self._stop()
            if want is not None:
                self._start(want)

    def _start(self, config: RdrConfig) -> None:
        from recorder.recorder import Recorder
        from recorder.triggers import Triggers

        self.recorder = Recorder(config, rank=rank(), world_size=world_size(), run_id=_RUN_ID, settings=_settings,
                                 versions=_versions())
        self.triggers = Triggers(self.recorder, mode=config.mode, op_timeout=config.op_timeout,
                                 hang_action=config.hang_action).install()

    def _retune(self, config: RdrConfig) -> None:
        assert self.recorder is not None and self.triggers is not None
        self.recorder.config = config
        self.triggers.stop_watchdog()
        self.triggers.mode, self.triggers.op_timeout = config.mode, config.op_timeout
        self.triggers.hang_action = config.hang_action
        self.triggers.start_watchdog()

    def _after_fork(self) -> None:
        """A forked child (a DataLoader worker) does not record: it lets go of the parent's recorder."""
        self._lock = threading.RLock()
        if self.triggers is not None:
            self.triggers.detach()
            self.triggers = None
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder = None

    def _stop(self) -> None:
        if self.triggers is not None:
            self.triggers.uninstall()
            self.triggers = None
        if self.recorder is not None:
            self.recorder.close(clean_exit=True)
            self.recorder = None


feature = RdrFeature()
os.register_at_fork(after_in_child=feature._after_fork)


def start_from_environment() -> None:
    """At import: ``MS_RDR_ENABLE=1`` alone turns the recorder on; bad variables warn instead of failing import."""
    if not os.environ.get("MS_RDR_ENABLE"):
        return
    try:
        feature.sync()
    except ObsError as exc:
        import warnings

        warnings.warn(f"Running Data Recorder not started: {exc}", _env_feature.ObsConfigWarning, stacklevel=3)


def recorder() -> Recorder | None:
    """The running recorder, or None when RDR is off."""
    return feature.recorder


def dump(reason: str = "manual") -> str:
    """Write a bundle now (``{path}/rank_{r}/rdr/{stamp}_{pid}_{reason}/``) and return its folder."""
    live = feature.recorder
    if live is None:
        raise ObsError("the Running Data Recorder is off: enable it with an env config file "
                       '{"rdr": {"enable": true, "path": "/abs/dir"}} (set_context(env_config_path=...)) '
                       "or MS_RDR_ENABLE=1")
    path = live.dump(reason)
    assert path is not None
    return path


def recover(path: str) -> list[str]:
    """Bundles made from the rings of dead processes under ``path`` (an rdr folder, a tree, or a ring file)."""
    from recorder.recover import recover_rings

    return recover_rings(path)

"""Wires the three dump features to the settings in force: exception_dump, the NaN/Inf check, the data dump.

Where each comes from (the first that says something wins):

* exception_dump: ``ascend_config={"exception_dump": "0"|"1"|"2"}`` (set explicitly); the env
  config's ``exception_dump`` section; a dump config with ``op_debug_mode`` 4 (inputs only).
* NaN check: the env config's ``nan_check`` section; a dump config with ``op_debug_mode`` 3.
* data dump: the env config's ``dump`` section; the JSON file named by ``MINDSPORE_DUMP_CONFIG`` /
  ``OBS_DUMP_CONFIG``, read at the first ``set_context`` call (any key) or by ``obs run``, as
  MindSpore reads it once.  A bad file makes that call fail with every problem listed.

Default folder of exception and NaN dumps: the section's ``path``, else the RDR path when the RDR
is on, else the working directory.  Each feature is (re)started only when its own settings change;
a feature that is off installs nothing.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from obs.features import env_config as env_feature
from obs.settings._context import snapshot
from obs.settings.context_options import CONTEXT_OPTIONS
from obs.settings.dump_config import ENV_VARS, DumpConfig, load_dump_config, parse_dump_config

__all__ = ["DumpFeature", "feature"]


@dataclass(frozen=True)
class _Wanted:
    exception: tuple[str, str] | None  # (mode, root)
    nan: tuple[str, str, bool, str, int, bool] | None  # (action, granularity, backward, root, limit, sync)
    data: DumpConfig | None


def _root(section_path: str, env: Mapping[str, Any]) -> str:
    if section_path:
        return section_path
    rdr = env.get("rdr", {})
    if rdr.get("enable") and rdr.get("path"):
        return str(rdr["path"])
    return os.getcwd()


def env_file_config(environ: Mapping[str, str] | None = None) -> DumpConfig | None:
    """The dump config named by ``MINDSPORE_DUMP_CONFIG`` (or ``OBS_DUMP_CONFIG``), validated; None when unset."""
    environ = os.environ if environ is None else environ
    for var in ENV_VARS:
        path = environ.get(var)
        if path:
            return load_dump_config(path, environ=environ)
    return None


class DumpFeature:
    """Starts and stops :class:`ExceptionDump`, :class:`NanCheck` and :class:`DataDump` to match the settings."""

    keys = frozenset(CONTEXT_OPTIONS)
    on_first_call = True  # the first set_context call reads the dump config variable, even set_context()

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.exception: Any = None
        self.nan: Any = None
        self.data: Any = None
        self._have = _Wanted(None, None, None)
        self._from_env: DumpConfig | None = None
        self._env_read = False
        env_feature.feature.listeners.append(self.sync)

    # -- applier protocol ---------------------------------------------------------------------
    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> DumpConfig | None:
        return self._from_env if self._env_read else env_file_config()

    def commit(self, prepared: DumpConfig | None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        self._from_env, self._env_read = prepared, True
        self.sync()

    def close(self) -> None:
        with self._lock:
            self._apply(_Wanted(None, None, None))
            self._from_env, self._env_read = None, False

    def start_from_environment(self) -> None:
        """``obs run``: a dump config variable takes effect even when no set_context call comes."""
        if not self._env_read:
            self._from_env, self._env_read = env_file_config(), True
        self.sync()

    # -- state ----------------------------------------------------------------------------------
    def desired(self) -> _Wanted:
        env = env_feature.env_config()
        data = self._from_env
        section = env.get("dump", {})
        if section.get("common_dump_settings"):
            body = {k: v for k, v in section.items() if v}
            # raw: the dump's metadata keeps the settings (initial_iteration numbers the steps in `obs dump ls`)
            data = parse_dump_config(body, source="env config section 'dump'", raw=json.dumps(body, indent=2))
        debug = data.op_debug_mode if data is not None else 0

        exc_section = env.get("exception_dump", {})
        ascend = snapshot().get("ascend_config", {})
        mode = None
        if "exception_dump" in ascend:
            mode = ascend["exception_dump"]
        elif exc_section.get("enable"):
            mode = exc_section.get("mode", "2")
        elif debug == 4:
            mode = "2"
        from_dump = data.path if data is not None and debug in (3, 4) else ""  # the dump config's own folder
        exception = (mode, _root(exc_section.get("path", "") or from_dump, env)) if mode in ("1", "2") else None

        nan_section = env.get("nan_check", {})
        nan = None
        if nan_section.get("enable") or debug == 3:
            root = _root(nan_section.get("path", "") or from_dump or exc_section.get("path", ""), env)
            # op_debug_mode 3 checks every op (as in MindSpore) and reports up to overflow_number findings (0: all,
            # one per step); the nan_check section, the first one
            limit = (data.overflow_number if data is not None and debug == 3 and not nan_section.get("enable")
                     else 1)
            granularity = nan_section.get("granularity", "module") if nan_section.get("enable") else "op"
            # sync: CUDA tensors checked where they are made (a host sync each), not once per step off-thread
            nan = (nan_section.get("action", "continue"), granularity,
                   bool(nan_section.get("backward", True)), root, limit, bool(nan_section.get("sync", False)))
        if debug in (3, 4):  # overflow-only / exception-only: the NaN check or exception_dump does the work
            data = None
        return _Wanted(exception, nan, data)

    def sync(self) -> None:
        """Bring the features in line with the settings in force."""
        with self._lock:
            self._apply(self.desired())

    def _apply(self, want: _Wanted) -> None:
        have = self._have
        if want.exception != have.exception:
            if self.exception is not None:
                self.exception.remove()
                self.exception = None
            if want.exception is not None:
                from obs.features.dump.exception import ExceptionDump

                self.exception = ExceptionDump(*want.exception).install()
        if want.nan != have.nan:
            if self.nan is not None:
                self.nan.remove()
                self.nan = None
            if want.nan is not None:
                from obs.features.dump.nan.check import NanCheck

                action, granularity, backward, root, limit, sync = want.nan
                self.nan = NanCheck(root, action=action, granularity=granularity, backward=backward,
                                    limit=limit, sync=sync).install()
        if want.data != have.data:
            if self.data is not None:
                self.data.remove()
                self.data = None
            if want.data is not None:
                from obs.features.dump.data_dump import DataDump

                self.data = DataDump(want.data).install()
        self._have = want


feature = DumpFeature()

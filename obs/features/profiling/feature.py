"""The profiler's applier, wired to the settings: ``enable_profiling`` / ``profiling_options`` and the env config
``profiler`` section (see :mod:`obs.settings.profiler_options`).

While it is on, a :class:`obs.features.profiling.profile_session.ProfileSession` records step, phase (and module, op)
timings into its ring and an exporter process turns them into spans.  A change of settings (a
hot reload is applied at a step boundary, on the training thread) ends the session in force (its
exporter drains and ends on its own) and starts one for the new settings, whose exporter begins writing once that one
has ended (one writer at a time for the folder's files); switching off ends it.  The capture window
(``profiler.window``) is the exception: its change goes to the session in force
(:meth:`ProfileSession.configure_window`), which switches its module / op subscriptions at step boundaries.
At exit the last session is closed, its status handed to each of ``exit_listeners`` (``obs run`` /
``obs demo`` print its summary) and a warning given when spans were dropped.  ``last_status()`` is
what the exporter of the last closed session reported.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from obs.features import env_config as env_feature
from obs.runtime import job
from obs.settings._context import get_context
from obs.settings.profiler_options import ProfileRequest, request

if TYPE_CHECKING:
    from obs.features.profiling.profile_session import ProfileSession

__all__ = ["ProfilerFeature", "ProfilerDropWarning", "feature", "last_status", "session"]

logger = logging.getLogger("obs")


class ProfilerDropWarning(UserWarning):
    """Spans were dropped (the exporter fell behind the ring, the collector was down or slow, a full disk)."""


class ProfilerFeature:
    """Starts, restarts and stops the profiling session to match the settings in force."""

    keys = frozenset({"enable_profiling", "profiling_options", "env_config_path"})

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.session: ProfileSession | None = None
        self._closing: list[ProfileSession] = []  # switched off or replaced; exporters still draining
        self.request: ProfileRequest | None = None
        self.statuses: list[dict[str, Any]] = []
        #: called with the last session's status at exit (the CLI renders its summary)
        self.exit_listeners: list[Callable[[Mapping[str, Any]], None]] = []
        self._atexit = False
        env_feature.feature.listeners.append(self.sync)

    def desired(self, values: Mapping[str, Any] | None = None) -> ProfileRequest | None:
        cfg = env_feature.feature.current()
        context = values if values is not None else {k: get_context(k) for k in ("enable_profiling",
                                                                                 "profiling_options")}
        return request(context, cfg.values["profiler"], cfg.origins["profiler"])

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        return None

    def commit(self, prepared: None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        self.sync()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def sync(self) -> None:
        with self._lock:
            want = self.desired()
            if want == self.request:  # the capture window is left out of the comparison: it never restarts
                if want is not None and self.request is not None and want.window != self.request.window:
                    self.request = want
                    if self.session is not None:
                        self.session.configure_window(want.window)
                return
            self._retire()  # never waits on the training thread: its exporter drains and ends by itself
            if want is not None:
                self._start(want)

    def _start(self, want: ProfileRequest) -> None:
        from obs.features.profiling.profile_session import ProfileSession

        who = job.identity()
        self.session = ProfileSession(want, rank=who.rank, world_size=who.world_size, run_id=who.run_id,
                                      versions=who.versions, rank_known=who.rank_known, earlier=self._closing)
        self.request = want
        if not (who.run_id_known and job.distributed_ready()):  # the rank is torch.distributed's once it is up
            from obs.runtime.steps import tracker

            tracker.at_boundary.add(self.check_identity)
        if not self._atexit:
            self._atexit = True
            atexit.register(self._at_exit)

    def check_identity(self) -> None:
        """At a step boundary, once torch.distributed is up: the job's agreed run id and this rank, so every rank's
        spans of a step share one trace id."""
        live = self.session
        if live is not None and not live.identity_known:
            if not job.distributed_ready():  # checked first: the launcher's run id is an environment read
                return
            where = job.distributed_rank()
            run_id = job.agree_run_id()
            if where is None or run_id is None:
                return
            live.set_identity(run_id, *where)
        self._unhook()

    def _unhook(self) -> None:
        from obs.runtime.steps import tracker

        tracker.at_boundary.remove(self.check_identity)

    def _retire(self) -> None:
        self._unhook()
        session, self.session, self.request = self.session, None, None
        if session is not None:
            session.close(wait_s=0.0)
            self._closing.append(session)

    def _stop(self) -> None:
        """End every session and wait (bounded) for their exporters: reset_context and exit."""
        self._retire()
        closing, self._closing = self._closing, []
        for session in closing:
            status = session.close()
            if status is not None:
                self.statuses.append(status)
                _warn_drops(status)

    def _after_fork(self) -> None:
        self._lock = threading.RLock()
        for live in [self.session, *self._closing]:
            if live is not None:
                live.detach()
        self.session, self.request, self._closing = None, None, []
        self.statuses = []
        self.exit_listeners = []

    def _at_exit(self) -> None:
        with self._lock:
            had = self.session is not None or bool(self._closing)
            self._stop()
        if had and self.statuses:
            for listener in self.exit_listeners:
                listener(self.statuses[-1])


def _warn_drops(status: Mapping[str, Any]) -> None:
    dropped = status.get("dropped") or {}
    total = sum(dropped.values())
    if not total:
        return
    where = status.get("endpoint") or "the local trace files"
    detail = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in sorted(dropped.items()))
    message = f"obs profiler dropped {total} spans sending to {where} ({detail})"
    lost = (status.get("ring_overrun") or {}).get("steps")
    if lost:
        message += (f"; {lost} steps were overwritten in the ring before the exporter read them (their spans are "
                    "estimated)")
    if status.get("last_error"):
        message += f"; last error: {status['last_error']}"
    logger.warning("%s", message)
    warnings.warn(message, ProfilerDropWarning, stacklevel=2)


feature = ProfilerFeature()
os.register_at_fork(after_in_child=feature._after_fork)


def session() -> ProfileSession | None:
    """The profiling session in force, or None when profiling is off."""
    return feature.session


def last_status() -> dict[str, Any] | None:
    """What the exporter of the last closed session reported (counts, drops, files, summary), or None."""
    return feature.statuses[-1] if feature.statuses else None

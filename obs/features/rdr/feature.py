"""The Running Data Recorder's applier: the recorder follows the settings in force (``env_config_path``'s rdr section,
``MS_RDR_*``, op_timeout).

It starts, retunes or restarts with set_context, hot reloads of the file (applied at a step boundary on the
training thread) and reset_context.  When the recording ends (the process, reset_context, the file turning
the recorder off) it writes the bundle it owes: one for a fault no bundle holds yet, in every mode, else
``normal_end`` in mode 2.  ``recorder`` is imported lazily so ``import obs`` stays light.  With
``rdr.memory_history`` the CUDA allocator keeps its newest events for a CUDA out of memory's bundle
(:mod:`obs.features.rdr.cuda_memory`).

Where files go: ``{rdr.path}/rank_{r}/rdr/``; an unset ``rdr.path`` is the current folder (as in
MindSpore's RDR).  A run that ends cleanly with nothing to report leaves nothing behind there: no
ring, no marker, no folder obs created.  The rank is torch.distributed's once ``init_process_group`` has run,
whatever came before: the recorder then moves under ``rank_{r}`` and takes its world size (checked at each step
boundary and before each bundle).  Before that, a process whose launcher gave no ``RANK`` but other ranks
(``torch.multiprocessing.spawn``; Lightning's launcher, with ``LOCAL_RANK`` and ``WORLD_SIZE``) records under
``rank_unresolved-{pid}``: two ranks never share a folder (see :func:`obs.settings.parallel.rank_given`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from obs._core import env
from obs._core.errors import ObsError
from obs.features import env_config as env_feature
from obs.features.rdr.cuda_memory import MemoryHistory, add_to_bundle
from obs.runtime import job
from obs.settings import parallel
from obs.settings._context import get_context, snapshot

if TYPE_CHECKING:
    from recorder.recorder import RdrConfig, Recorder
    from recorder.triggers import Triggers

__all__ = ["RdrFeature", "dump", "feature", "recorder", "recover", "start_from_environment"]


def _settings() -> dict[str, Any]:
    return {"context": {k: v for k, v in snapshot().items()}, "env_config": env_feature.env_config()}


class RdrFeature:
    """Starts, reconfigures and stops the recorder to match the settings in force."""

    keys = frozenset({"env_config_path", "op_timeout"})

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.recorder: Recorder | None = None
        self.triggers: Triggers | None = None
        self._notice: Any = None  # what the recorder cannot see inside compiled code, said at the first compile
        self._run_id_known = True
        self.memory_history = MemoryHistory()  # rdr.memory_history: the CUDA allocator's history for OOM bundles
        env_feature.feature.listeners.append(self.sync)

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        return None  # the env config file is checked by its own applier, which runs first

    def commit(self, prepared: None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        self.sync()

    def close(self) -> None:
        with self._lock:
            self._stop(ending=True)
            self.memory_history.apply(0)

    def desired(self) -> RdrConfig | None:
        rdr = env_feature.env_config()["rdr"]
        if not rdr["enable"]:
            return None
        from obs.settings.monitor_options import ring_capacity
        from recorder.layout import DEFAULT_CAPACITY
        from recorder.recorder import RdrConfig

        # the training-health monitor's last steps and anomalies, while its section is on (a change restarts the ring)
        monitor = ring_capacity(env_feature.env_config().get("monitor", {}))
        return RdrConfig(path=rdr["path"], mode=rdr["mode"], granularity=rdr["granularity"],
                         capacity={**DEFAULT_CAPACITY, **rdr["capacity"], **monitor},
                         op_timeout=get_context("op_timeout"),
                         hang_action=rdr["hang_action"])

    def sync(self) -> None:
        """Bring the recorder in line with the settings (start, restart on a new layout, or stop)."""
        with self._lock:
            want = self.desired()
            rdr = env_feature.env_config()["rdr"]
            self.memory_history.apply(rdr.get("memory_history", 0) if want is not None else 0)
            have = self.recorder.config if self.recorder is not None else None
            if want == have:
                return
            if want is not None and have is not None and (want.path, want.granularity, want.capacity) == \
                    (have.path, have.granularity, have.capacity):
                self._retune(want)
                return
            self._stop(keep_signals=want is not None, ending=want is None)  # a restart keeps the signal relay
            if want is not None:
                self._start(want)

    def _start(self, config: RdrConfig) -> None:
        from obs.runtime.steps import tracker
        from recorder.recorder import Recorder
        from recorder.triggers import Triggers

        who = job.identity()
        self._run_id_known = who.run_id_known
        self.recorder = Recorder(config, rank=who.rank, world_size=who.world_size, run_id=who.run_id,
                                 settings=_settings, versions=who.versions, rank_known=who.rank_known)
        self.recorder.identity = job.distributed_rank
        # collectives are recorded (granularity step and up): those PyTorch issued from C++ too
        self.recorder.amend_files = functools.partial(self._amend_bundle, collectives=config.granularity != "off")
        if config.granularity in ("module", "op"):
            from obs.features.compiled_notice import CompiledNotice

            self._notice = CompiledNotice("the Running Data Recorder", (
                "a compiled module is recorded as one module (the modules inside it run inside its graphs)"
                + ("; the ops its graphs still run one by one are recorded, Inductor's fused kernels are not"
                   if config.granularity == "op" else "")))
        self.triggers = Triggers(self.recorder, mode=config.mode, op_timeout=config.op_timeout,
                                 hang_action=config.hang_action).install()
        # Until torch.distributed is up (a launcher's rank 0 looks like a plain process until then) or the job's run
        # id is agreed: one check per step boundary.
        if (not job.distributed_ready() or not self._run_id_known) and self.check_rank not in tracker.at_boundary:
            tracker.at_boundary.add(self.check_rank)

    def check_rank(self) -> None:
        """Once torch.distributed is initialised: take its rank and world size (moving a recorder started under
        another folder), and agree on the job's run id with the other ranks."""
        live = self.recorder
        if live is None:
            self._unhook_rank_check()
            return
        if parallel.distributed() is None:  # the look at every boundary of a plain process: keep it to one call
            return
        where = job.distributed_rank()
        if where is not None:
            # The rank first: the run id rewrites the marker, and until the move it would rewrite the one in the
            # folder the recorder guessed (a guessed rank 0 shares rank_0 with the real rank 0's marker).
            moved = live.resolve_rank(*where)
            if not self._run_id_known:
                agreed = job.agree_run_id()
                if agreed is not None:
                    self._run_id_known = True
                    live.set_run_id(agreed)
            if moved and self._run_id_known:
                self._unhook_rank_check()

    def _unhook_rank_check(self) -> None:
        from obs.runtime.steps import tracker

        tracker.at_boundary.remove(self.check_rank)

    def _retune(self, config: RdrConfig) -> None:
        assert self.recorder is not None and self.triggers is not None
        self.recorder.config = config
        self.triggers.stop_watchdog()
        self.triggers.mode, self.triggers.op_timeout = config.mode, config.op_timeout
        self.triggers.hang_action = config.hang_action
        self.triggers.start_watchdog()

    def _amend_bundle(self, files: dict[str, Any], *, collectives: bool) -> None:
        """What the live process adds to a bundle: PyTorch's Flight Recorder collectives, an OOM's CUDA memory."""
        if "device_fault.json" in files:
            add_to_bundle(files, self.memory_history.entries)
        if collectives:
            _flight_recorder_collectives(files)

    def _after_fork(self) -> None:
        """A forked child (a DataLoader worker) does not record: it lets go of the parent's recorder."""
        self._lock = threading.RLock()
        self.memory_history.forget()
        if self.triggers is not None:
            self.triggers.detach()
            self.triggers = None
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder = None
        if "recorder.signals" in sys.modules:
            sys.modules["recorder.signals"].after_fork_in_child()

    def _stop(self, *, keep_signals: bool = False, ending: bool) -> None:
        """``ending``: the recording ends (its last bundle, mode 2's ``normal_end`` included); else it restarts
        on a new layout (only a fault no bundle holds is written: its ring goes)."""
        if self.triggers is not None:
            self.triggers.end(stopping=ending)
            self.triggers.uninstall()
            self.triggers = None
        if self.recorder is not None:
            self.recorder.close(clean_exit=True)
            self.recorder = None
        if self._notice is not None:
            self._notice.remove()
            self._notice = None
        self._unhook_rank_check()
        if not keep_signals and "recorder.signals" in sys.modules:
            # Only on the main thread; elsewhere the relay stays, with no recorder behind it.
            sys.modules["recorder.signals"].uninstall_relay()


def _flight_recorder_collectives(files: dict[str, Any]) -> None:
    """The collectives PyTorch's Flight Recorder holds that obs did not record (DDP's buckets) into a bundle."""
    if "torch.distributed" in sys.modules:
        from obs.runtime.torch import add_flight_recorder_to_bundle

        add_flight_recorder_to_bundle(files)


feature = RdrFeature()
os.register_at_fork(after_in_child=feature._after_fork)


def start_from_environment() -> None:
    """At import: ``MS_RDR_ENABLE=1`` alone turns the recorder on; bad variables warn instead of failing import."""
    if not env.text(env.MS_RDR_ENABLE):
        return
    try:
        feature.sync()
    except ObsError as exc:
        import warnings

        warnings.warn(f"Running Data Recorder not started: {exc}", env_feature.ObsConfigWarning, stacklevel=3)


def recorder() -> Recorder | None:
    """The running recorder, or None when RDR is off."""
    return feature.recorder


def dump(reason: str = "manual") -> str:
    """Write a bundle now (``{path}/rank_{r}/rdr/{stamp}_{pid}_{reason}/``) and return its folder."""
    feature.check_rank()
    live = feature.recorder
    if live is None:
        raise ObsError("the Running Data Recorder is off: enable it with an env config file "
                       '{"rdr": {"enable": true, "path": "/abs/dir"}} (set_context(env_config_path=...)) '
                       "or MS_RDR_ENABLE=1")
    path = live.dump(reason)
    if path is None:  # called from a handler that interrupted a dump on this thread: never re-entered
        raise ObsError("a dump is already under way on this thread (obs.rdr.dump was called from a signal "
                       "handler during a dump); that dump goes on")
    return path


def recover(path: str) -> list[str]:
    """Bundles made from the rings of dead processes under ``path`` (an rdr folder, a tree, or a ring file)."""
    from recorder.recover import recover_rings

    return recover_rings(path)

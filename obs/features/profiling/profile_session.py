"""One profiling session in the training process: a profile ring, the subscriptions that fill it, the exporter.

The training thread only writes timestamps into slots of a memory-mapped ring (the recorder's format
and writer; module and op events through the recorder's C hot path): no span object, encoding or
socket lives here.  The exporter process (``python -m exporters``) reads the ring as it fills; it ends
when :meth:`ProfileSession.close` closes its stdin pipe, or when this process dies (the pipe closes;
the ring on disk keeps the last steps for it).  Where no process can be started, the exporter runs on
a thread here instead (it then competes with training for the GIL), and says so once.

With metrics on (``profiler.metrics``, ``OTEL_METRICS_EXPORTER``) the session also writes each step end's
memory reading (MEMORY: ``c`` the bytes in use, ``d`` the peak: CUDA's allocated peak, on CPU the resident
size), every finished collective (COLLECTIVE: ``c`` its duration), ``obs.scalar`` values (SCALAR) and each NaN/Inf
finding of the NaN check (a ``nan_inf`` MARKER blob); the exporter turns them, with the steps and phases, into
OpenTelemetry metrics.

Capture windows (:mod:`obs.features.profiling.window`): the session subscribes module (and op) events only for the
steps a window covers, switched at step boundaries on the training thread; its own request watcher on
``{output}/requests/`` answers ``obs trace capture``.

Device time (:mod:`obs.features.profiling.device_recording`): once CUDA is in use, steps, phases, modules and blocking
collectives are also timed with CUDA events (DEVICE_TIME slots, written by a poller thread), each step's memory peaks
are written (MEMORY_PEAK), and ``op_trace`` windows capture their kernels.

Files: ``{output}/rank_{r}/profile_{pid}_{n}.obsring`` while it runs (removed by the exporter), the
trace files and ``status_{pid}.json`` (counts, drops, the summary) written by the exporter.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from exporters.file_sd import FOLDER
from obs._core import outputs, safe_files
from obs._core.events import Event
from obs._core.json_files import read_json
from obs._core.rank_folders import rank_folder
from obs.features.profiling import device_recording, scalars
from obs.features.profiling.window import CAPTURE, Windows
from obs.settings.profiler_options import LEVELS, CaptureWindow, ProfileRequest
from recorder.collective_desc import COLLECTIVE_STATES
from recorder.layout import PHASE_CODES, STEP_TIMED, Kind
from recorder.requests import RequestWatcher
from recorder.ring_handlers import RingSubscriptions

__all__ = ["ProfileSession"]

logger = logging.getLogger("obs")

_EXIT_WAIT_S = 15.0
#: at close, the device times still being run wait this long at most (the device's backlog: a step or two)
_DEVICE_DRAIN_S = 0.5
_fallback_said = False


def _capacity(levels: tuple[str, ...], metrics: bool = False, device: bool = False) -> dict[str, int]:
    # Module and op slots are always there: a capture window can ask for them at any step (7 MiB of module and
    # 3.5 MiB of op slots reserved when the base level records neither).  Device slots where CUDA may be used.
    capacity = {"step": 65536 if metrics else 16384, "module": 131072,
                "op": 262144 if "op_trace" in levels else 65536, "memory": 4096 if metrics or device else 16,
                "collective": 16384 if metrics else 16, "blob": 16}
    if device:
        capacity["device"] = device_recording.DEVICE_SLOTS
    return capacity


class ProfileSession:
    """Records one request's events into a fresh ring and runs its exporter until :meth:`close`."""

    _serial = 0

    def __init__(self, request: ProfileRequest, *, rank: int, world_size: int, run_id: str,
                 versions: dict[str, str], rank_known: bool = True, earlier: Sequence[ProfileSession] = ()) -> None:
        """``earlier``: this process's sessions before this one (a hot reload restarted the profiler): where one wrote
        to the same folder, this session's exporter begins once that one's has ended."""
        from recorder.ring import RingWriter

        ProfileSession._serial += 1
        self.request, self.rank = request, rank
        self.step = 0  #: stamped into module slots by the Python handlers
        self.pid = os.getpid()
        # A process whose rank is a guess (a launcher gave no RANK; before init_process_group) never shares a rank's
        # folder: it keeps rank_unresolved-{pid}, its spans carry the rank set_identity() gives.
        self.folder = os.path.join(request.output, rank_folder(rank, unresolved_pid=None if rank_known else self.pid))
        self.identity_known = False  #: set_identity() ran (or the launcher told rank and run id up front)
        safe_files.ensure_dir(self.folder)
        self.ring_path = os.path.join(self.folder, f"profile_{self.pid}_{ProfileSession._serial}.obsring")
        cuda = device_recording.cuda_build()
        self.ring = RingWriter(self.ring_path, _capacity(request.levels, bool(request.metrics), cuda), pid=self.pid,
                               rank=rank, world_size=world_size,
                               meta={"run_id": run_id, "host": socket.gethostname(), "versions": versions,
                                     "profile": list(request.levels), "argv": sys.argv[:4]})
        self.status_path = os.path.join(self.folder, f"status_{self.pid}.json")
        self._after = tuple(s.ring_path for s in earlier if s.folder == self.folder)
        self._subs = RingSubscriptions(self.ring)
        self._modules = RingSubscriptions(self.ring)  # the base level's module subscription
        #: device time (CUDA events) while CUDA is in use; replaced at each (re)subscription
        self.device = device_recording.DeviceRecording(self.ring, watch=False)
        self._cuda = cuda
        #: capture windows (the env config's, obs trace capture's): detail for their steps only
        self.windows = Windows(request.window)
        self._detail = RingSubscriptions(self.ring)  # a window's module / op subscriptions, beyond the base level
        self.detail: str | None = None  #: the window level subscribed now (None: the base level only)
        self._requests: RequestWatcher | None = None
        #: obs.scalar's writer while metrics are on
        self.scalars: scalars.ScalarWriter | None = scalars.ScalarWriter(self.ring) if request.metrics else None
        self._process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.status: dict[str, Any] | None = None
        try:
            self._subscribe()
            self._start_exporter()
            self._start_requests()
        except BaseException:
            self._stop_requests()
            self._unsubscribe()
            self.ring.close(remove=True)
            raise

    def set_identity(self, run_id: str, rank: int, world_size: int) -> None:
        """The job's run id and this rank, agreed after init_process_group: the exporter applies them from here."""

        self.identity_known = True
        self.rank = rank  # capture answers go out as this rank
        if not self.ring.closed:
            self.ring.blob(Kind.MARKER, {"marker": "identity", "run_id": run_id, "rank": rank,
                                         "world_size": world_size})

    # -- recording ----------------------------------------------------------------------------
    def _subscribe(self) -> None:
        from obs.runtime.steps import tracker

        step_ring = self._subs.appender("step")
        pack, mm, base, cap, size, counter, seqs, clock = self.ring.slots("step")
        begin, end, phase = int(Kind.STEP_BEGIN), int(Kind.STEP_END), int(Kind.PHASE)
        self.device = dev = device_recording.DeviceRecording(self.ring, watch=self._cuda)
        subs, detail, me, writer = self._subs, self._detail, self, self.scalars

        def on_step_begin(number: int) -> None:
            me.step = number
            subs.step_begins(number)
            if detail.writers:
                detail.step_begins(number)
            timer = dev.timer
            if timer is None:
                step_ring(begin, 0, 0, number, 0, 0)
                return
            step_ring(begin, STEP_TIMED, 0, number, 0, 0)
            timer.step_begins(number)  # after the slot: the device reaches the reference after the host wrote it
            if dev.kernels is not None:
                dev.kernels_step(number)

        def on_step_end(number: int, duration_ns: int) -> None:
            step_ring(end, 0, 0, number, duration_ns, 0)
            timer = dev.timer
            if timer is not None:
                timer.step_ends(number)

        def on_phase(name: str, begin_ns: int, end_ns: int) -> None:
            # Written inline (not through an appender) for its seq: the phase's device time is keyed by it.
            code = PHASE_CODES.get(name, 9)
            idx, number = next(counter), next(seqs)
            pack(mm, base + (idx % cap) * size, number, idx + 1, clock(), phase, 0, code, tracker.step, begin_ns,
                 end_ns)
            timer = dev.timer
            if timer is not None and code:  # the data phase runs no device work of the step
                timer.mark(code, number)

        subs.add(Event.STEP_BEGIN, on_step_begin)
        subs.add(Event.STEP_END, on_step_end)
        subs.add(Event.PHASE, on_phase)
        self._subscribe_modules()
        if "op_trace" in self.request.levels:
            subs.ops(native=False)  # the native observer serves one ring at a time: the recorder's
        if writer is not None:
            self._subscribe_metrics()
            scalars.attach(writer)
        tracker.at_boundary.add(self.at_boundary)
        self._set_detail(self.windows.level(_current_step()), _current_step())

    def _subscribe_modules(self) -> None:
        """The base level's module events (op_trace names each op's module), timed on the device once it is."""
        self._modules.close()
        if "task_trace" in self.request.levels or "op_trace" in self.request.levels:
            self._modules.modules(self, timer=self.device.timer, depth=self.request.module_depth)

    # -- capture windows ------------------------------------------------------------------------
    def at_boundary(self) -> None:
        """Between steps, on the training thread: captures asked for since the last boundary begin with the next
        step, and the next step's detail is subscribed (or dropped)."""
        windows = self.windows
        if not (windows.pending or windows.captures or windows.config is not None or self.detail is not None
                or self.device.watch):
            return  # twice a step: nothing asked, configured, in force or watched, so nothing to change
        from obs.runtime.steps import tracker

        following = tracker.step + 1
        if self.windows.pending:
            self.windows.place(following)
        dev = self.device
        if dev.watch:
            if dev.timer is None:
                if dev.ready():
                    dev.activate()
                    self._subscribe_modules()  # the module handlers that time
                    self.detail = "-"  # and the window's, below
            else:
                dev.poll()
        self._set_detail(self.windows.level(following), following)

    def configure_window(self, window: CaptureWindow | None) -> None:
        """The env config's window changed (a hot reload, applied at a step boundary): no new session."""
        self.windows.configure(window)
        if self._subs:
            self._set_detail(self.windows.level(_current_step()), _current_step())

    def _set_detail(self, level: str | None, step: int) -> None:
        """Subscribe what ``level`` adds to the base level from ``step`` on: module events (task_trace, op_trace),
        op events (op_trace); None drops them, so the adapter publishes no module event and removes its op
        interceptor.  On the device an op_trace window also captures its kernels."""
        was = self.detail
        if level == was:
            return
        base = self.request.levels
        self._detail.close()
        self.detail = level
        if level is not None and "task_trace" not in base and "op_trace" not in base:
            self._detail.modules(self, timer=self.device.timer, depth=self.request.module_depth)
        if level == "op_trace" and "op_trace" not in base:
            self._detail.ops(native=False)  # the native observer serves one ring at a time: the recorder's
        if self._detail.writers:
            self._detail.step_begins(self.step)  # STEP_BEGIN stamps the next one
        if was == "op_trace" and level != "op_trace":
            self.device.kernels_finish(step - 1)
        elif level == "op_trace" and was != "op_trace":
            self.device.kernels_start(step)

    def _subscribe_metrics(self) -> None:
        """Memory at each step end and every finished collective, for the exporter's metrics."""
        memory_ring, collective_ring = self._subs.appender("memory"), self._subs.appender("collective")
        intern = self.ring.intern
        memory, collective = int(Kind.MEMORY), int(Kind.COLLECTIVE)
        finished = {COLLECTIVE_STATES.index("completed"), COLLECTIVE_STATES.index("failed")}
        states = {name: code for code, name in enumerate(COLLECTIVE_STATES)}

        def on_memory(number: int, stats: dict[str, Any]) -> None:
            used = int(stats.get("allocated_bytes.all.current", stats.get("rss_bytes", 0)))
            peak = int(stats.get("allocated_bytes.all.peak", used))
            memory_ring(memory, 0, intern(str(stats.get("device", "?"))), number, used, peak)

        def on_collective(record: dict[str, Any]) -> None:
            state = states.get(record.get("state", ""), -1)
            if state in finished:  # scheduled and started carry no duration yet
                collective_ring(collective, 1 if record.get("error") else 0, intern(str(record.get("op", "?"))),
                                int(record.get("seq", 0)), int(record.get("duration_ns", 0)), state)

        def on_fault(kind: str, detail: Any = None, error: Any = None) -> None:
            if kind == "nan_inf" and not self.ring.closed:  # the NaN check's finding: counted by the exporter
                self.ring.blob(Kind.MARKER, {"marker": "nan_inf"})

        self._subs.add(Event.MEMORY, on_memory)
        self._subs.add(Event.COLLECTIVE, on_collective)
        self._subs.add(Event.FAULT, on_fault)

    def pause(self) -> None:
        """Stop recording (every hook it needed goes, when nothing else needs it); the exporter stays."""
        self._unsubscribe()

    def resume(self) -> None:
        """Record again after :meth:`pause`."""
        if not self._subs and not self.ring.closed:
            self._subscribe()

    def _unsubscribe(self, wait_s: float = _DEVICE_DRAIN_S) -> None:
        from obs.runtime.steps import tracker

        tracker.at_boundary.remove(self.at_boundary)
        if self.scalars is not None:
            scalars.detach(self.scalars)
        self._detail.close()
        self.detail = None
        self._modules.close()
        self._subs.close()
        self.device.close(wait_s)  # the poller writes what the device completes within wait_s

    # -- the exporter ---------------------------------------------------------------------------
    def _config(self) -> Any:
        from exporters.sidecar import ExportConfig

        r = self.request
        return ExportConfig(ring=self.ring_path, folder=self.folder, levels=_export_levels(r.levels),
                            endpoint=r.endpoint, protocol=r.protocol, steps=r.steps, span_budget=r.span_budget,
                            module_depth=r.module_depth, max_file_mb=r.max_file_mb, trainer_pid=self.pid,
                            metrics=r.metrics, prometheus_host=r.prometheus[0], prometheus_port=r.prometheus[1],
                            batch_size=r.batch_size, tokens_per_step=r.tokens_per_step, after=self._after,
                            targets=os.path.join(r.output, FOLDER) if "prometheus" in r.metrics else "")

    def _start_exporter(self) -> None:
        config = self._config()
        # The exporter imports obs (safe_files): it must not turn on obs's features from the trainer's variables.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "MINDSPORE_", "OBS_CONFIG"))}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self._process = subprocess.Popen([sys.executable, "-m", "exporters", "--config", config.to_json()],
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                                             start_new_session=True, close_fds=True)
        except OSError as exc:
            self._start_thread(config, exc)
            return
        _off_training_cores(self._process.pid)

    def _start_thread(self, config: Any, why: BaseException) -> None:
        global _fallback_said
        from exporters.sidecar import run

        if not _fallback_said:
            _fallback_said = True
            logger.warning("obs profiler: no exporter process could be started (%s); exporting on a thread of the "
                           "training process instead, which competes with training for the GIL", why)
        stop = self._stop

        def alive(timeout: float) -> bool:
            return not stop.wait(timeout)

        self._thread = threading.Thread(target=run, args=(config, alive), name="obs-profile-exporter", daemon=True)
        self._thread.start()

    # -- capture requests (recorder.requests, in the output folder) -----------------------------
    def _start_requests(self) -> None:
        """This session's own watcher of ``{output}/requests/``: ``obs trace capture`` reaches every rank through
        it, with or without the RDR."""
        from obs.runtime.steps import tracker

        windows = self.windows

        def capture(request: Any) -> dict[str, Any]:
            return windows.handle(request, step=tracker.step)

        self._requests = RequestWatcher(self.request.output, {CAPTURE: capture}, rank=lambda: self.rank,
                                        name="obs-profile-requests").start()

    def _stop_requests(self) -> None:
        self.windows.close()  # a capture waiting for a boundary is answered now
        watcher, self._requests = self._requests, None
        if watcher is not None:
            watcher.stop()

    # -- lifecycle ------------------------------------------------------------------------------
    def detach(self) -> None:
        """In a forked child (a DataLoader worker): let go of the parent's ring and pipe, touching neither."""
        if self._requests is not None:
            self._requests.detach()
            self._requests = None
        self.device.detach()
        if self.scalars is not None:
            self.scalars.abandon()
        self._unsubscribe()
        self.ring.abandon()
        process, self._process = self._process, None
        if process is not None and process.stdin is not None:
            try:
                os.close(process.stdin.fileno())
            except OSError:
                pass
        self._thread = None

    def close(self, *, wait_s: float = _EXIT_WAIT_S) -> dict[str, Any] | None:
        """Stop recording, let the exporter drain the ring and end; the exporter's status (None if it did not
        end within ``wait_s``)."""
        self._stop_requests()
        self._unsubscribe(_DEVICE_DRAIN_S)  # whatever wait_s: a session replaced mid-run keeps its last device times
        if not self.ring.closed:
            if self.scalars is not None:
                self.scalars.close()  # the last device copies of obs.scalar values are written first
            self.ring.close(remove=False)  # the exporter reads the file to the end, then removes it
        deadline = time.monotonic() + wait_s
        if self._process is not None:
            if self._process.stdin is not None:
                try:
                    self._process.stdin.close()
                except OSError:
                    pass
            try:
                self._process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                return None
        self.status = _own_status(_read_status(self.status_path), self.ring_path)
        if self.status is not None:
            for path in self.status.get("files", []):
                if os.path.exists(path):
                    outputs.wrote("trace", path)
        return self.status


def _export_levels(levels: tuple[str, ...]) -> tuple[str, ...]:
    """What the exporter builds spans of: every level (the ring holds module and op slots only for the steps of
    the base level's and the capture windows' detail), except where the base records modules only to name ops."""
    if "op_trace" in levels and "task_trace" not in levels:
        return levels
    return LEVELS


def _current_step() -> int:
    """The step that records now: the one under way, else the next one."""
    from obs.runtime.steps import tracker

    return tracker.step if tracker.in_step else tracker.step + 1


def _off_training_cores(pid: int) -> None:
    """A trainer pinned to some cores keeps them: its exporter runs on the others (when there are any)."""
    try:
        mine, every = os.sched_getaffinity(0), set(range(os.cpu_count() or 1))
        others = every - mine
        if others:
            os.sched_setaffinity(pid, others)
    except (AttributeError, OSError):
        pass


def _own_status(status: dict[str, Any] | None, ring: str) -> dict[str, Any] | None:
    """A session's status in its trainer's status file: the file's own, or one of its ``previous`` (a later session's
    exporter took the file over)."""
    if status is None or status.get("ring", ring) == ring:
        return status
    found = [s for s in status.get("previous") or () if isinstance(s, dict) and s.get("ring") == ring]
    return found[-1] if found else None


def _read_status(path: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = read_json(path, what="an exporter's status file")
    except (OSError, ValueError):
        return None
    return data

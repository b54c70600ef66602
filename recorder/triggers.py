"""What makes a recorder dump: uncaught exceptions, signals, fatal signals, hangs, requests, the end of the run.

Each trigger chains to what was installed before it (the previous excepthook or signal
handler still runs, and a process killed by a signal still dies of it, with the same status
as without obs).  ``uninstall()`` puts every previous handler back.  SIGTERM and SIGINT go
through :mod:`recorder.signals` (a C handler and a watcher thread: they work while the main
thread is blocked in C); the triggers are its target.

Requests (:mod:`recorder.requests`): a ``snapshot`` request in the RDR root's ``requests/`` folder (``obs rdr
snapshot``, or a peer whose hang watchdog fired) makes a bundle now and the run goes on: reason ``snapshot``, or
``peer_hang`` when a peer asked on its hang (the manifest's ``fault`` names who asked).  A rank whose watchdog fires
asks its peers so, after its own ``hang`` bundle: every rank's stacks of the same hang.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from obs._core import safe_files
from obs._core.internal import report_internal_error
from obs._core.json_files import read_json
from recorder import signals
from recorder.recorder import Recorder
from recorder.requests import Request, RequestWatcher, make_request, remove_request, write_answer, write_request

__all__ = ["Triggers", "progress"]

_SNAPSHOT_WAIT_S = 5.0  # a snapshot waits this long for a dump under way on another thread, then says it is busy
_DUMP_SWITCH_S = 0.0005  # the GIL's switch interval while a snapshot dumps (Python's default: 0.005)
_PEERS_WAIT_S = 3.0  # with hang_action abort: how long the rank waits for its peers' bundles before it aborts


def progress(recorder: Recorder) -> int:
    """How many events the ring has recorded so far (read without touching the hot path)."""
    return recorder.ring.recorded()


class Triggers:
    """Installs the dump triggers of one recorder."""

    def __init__(self, recorder: Recorder, *, mode: int, op_timeout: int, hang_action: str) -> None:
        self.recorder = recorder
        self.mode, self.op_timeout, self.hang_action = mode, op_timeout, hang_action
        self.abnormal = False  #: an exception or signal ended (or is ending) the run
        self.signalled: str | None = None  #: the signal being handled (its dump is the fault's one dump)
        self._prev_sys: Any = None
        self._prev_thread: Any = None
        self._fatal: Any = None
        self._faulthandler_was: bool = False
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._requests: RequestWatcher | None = None
        self._asked: list[Request] = []  # the requests this process made (on a hang): removed when it stops
        #: (progress when taken, path) of this rank's bundle of the current stall (hang, peer_hang): the same stall
        #: is not dumped twice
        self._stall: tuple[int, str] | None = None

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> Triggers:
        """Hooks, the fatal-signal file, the watchdog; SIGTERM/SIGINT through the process's signal relay
        (installed now when this is the main thread; off it, only an already installed relay is used)."""
        self._prev_sys, sys.excepthook = sys.excepthook, self._sys_hook
        self._prev_thread, threading.excepthook = threading.excepthook, self._thread_hook
        relay = signals.install_relay()
        if relay is not None:
            relay.target = self
        self._fatal = os.fdopen(safe_files.create_file(self.recorder.fatal_path), "w")
        self._faulthandler_was = faulthandler.is_enabled()
        faulthandler.enable(self._fatal, all_threads=True)
        self.start_watchdog()
        self.start_requests()
        atexit.register(self._at_exit)
        return self

    def uninstall(self) -> None:
        atexit.unregister(self._at_exit)
        self.stop_watchdog()
        self.stop_requests()
        self._restore(close_fatal_file=True)

    def detach(self) -> None:
        """In a forked child: put every handler back without dumping or closing anything."""
        atexit.unregister(self._at_exit)
        self._watchdog = None  # threads do not survive fork
        if self._requests is not None:
            self._requests.detach()
            self._requests = None
        self._asked = []  # the parent's requests: the parent removes them
        self._restore(close_fatal_file=False)  # the parent's file: the child only drops its copy

    def _restore(self, *, close_fatal_file: bool) -> None:
        if sys.excepthook == self._sys_hook:
            sys.excepthook = self._prev_sys
        if threading.excepthook == self._thread_hook:
            threading.excepthook = self._prev_thread
        relay = signals.relay()
        if relay is not None and relay.target is self:
            relay.target = None  # the relay itself is restored by whoever stops the recorder (main thread)
        if self._fatal is not None:
            faulthandler.disable()
            if self._faulthandler_was:
                _give_faulthandler_back()
            if close_fatal_file:
                self._fatal.close()
            self._fatal = None

    def start_watchdog(self) -> None:
        if self.op_timeout > 0 and self.recorder.config.granularity != "off" and self._watchdog is None:
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name="obs-rdr-watchdog", daemon=True)
            self._watchdog.start()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._stop.set()
            self._watchdog.join()
            self._watchdog = None

    @property
    def root(self) -> str:
        """The RDR root (the folder of the ``rank_{r}/rdr`` trees), where the request folder is."""
        return os.path.dirname(os.path.dirname(self.recorder.dir))

    def start_requests(self) -> None:
        """The request watcher (every granularity, whatever ``op_timeout``)."""
        if self._requests is None:
            recorder = self.recorder
            self._requests = RequestWatcher(self.root, {"snapshot": self._snapshot},
                                            rank=lambda: recorder.rank).start()

    def stop_requests(self) -> None:
        """Stop the watcher (joined) and remove the requests this process made, with their answers."""
        watcher, self._requests = self._requests, None
        if watcher is not None:
            watcher.stop()
            for request in self._asked:
                try:
                    remove_request(watcher.folder, request)
                except OSError as exc:
                    report_internal_error("rdr requests: removing a hang request", exc)
        self._asked = []

    # -- triggers -----------------------------------------------------------------------------
    def _dump(self, reason: str, **kwargs: Any) -> str | None:
        try:
            return self.recorder.dump(reason, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a failed dump must not change how the process ends
            report_internal_error(f"rdr dump ({reason})", exc)
            return None

    def _sys_hook(self, etype: type[BaseException], value: BaseException, tb: Any) -> None:
        self.abnormal = True
        if not (isinstance(value, KeyboardInterrupt) and self.signalled):
            self._dump("exception", error=value, fault={"kind": "exception", "where": "main thread"})
        self._prev_sys(etype, value, tb)

    def _thread_hook(self, args: Any) -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "?"
            self._dump("thread_exception", error=args.exc_value, fault={"kind": "thread_exception", "where": name})
        self._prev_thread(args)

    # -- the signal relay's target (recorder.signals.SignalTarget) -------------------------------
    def signal_dump(self, name: str, budget_s: float) -> bool:
        """On the relay's thread: one bundle for this signal, or the end of a dump already under way."""
        self.abnormal = True
        self.signalled = name
        recorder = self.recorder
        recorder.marker("signal", signal=name)
        if recorder.busy():  # exactly one dump per fault: the one under way is it
            return recorder.wait_idle(budget_s) and recorder.failed is None
        done = threading.Event()

        def run() -> None:
            try:
                self._dump(name, fault={"kind": "signal", "where": name})
            finally:
                done.set()

        # On its own thread so the budget holds however long the dump would take: past it, the
        # process ends and the ring stays for obs rdr recover.
        threading.Thread(target=run, name="obs-rdr-signal-dump", daemon=True).start()
        return done.wait(budget_s) and recorder.failed is None and bool(recorder.dumps)

    def dumping_here(self) -> bool:
        return self.recorder.dumping_here()

    def stop_dumps(self, budget_s: float) -> bool:
        return self.recorder.stop_dumps(budget_s)

    def ending(self, name: str, complete: bool) -> None:
        """The process dies of ``name`` next: the ring goes only when its bundle is on disk."""
        recorder = self.recorder
        if recorder.ring.closed:
            return
        removed = complete and recorder.remove_ring()
        recorder.finish(f"killed by {name}", ring_removed=removed)

    def _watch(self) -> None:
        interval = min(1.0, self.op_timeout / 4)
        last, since, fired = -1, time.monotonic(), False
        while not self._stop.wait(interval):
            now, count = time.monotonic(), progress(self.recorder)
            if count != last:
                last, since, fired = count, now, False
                continue
            if fired or self.recorder.step < 1 or now - since < self.op_timeout:
                continue
            fired = True
            idle = round(now - since, 3)
            stall = self._stall
            asked = stall is not None and stall[0] == count  # a peer asked on this very stall: the ranks were asked
            self.recorder.marker("hang", idle_s=idle)
            where = f"no progress for {idle} s (op_timeout {self.op_timeout} s) in step {self.recorder.step}"
            with _eager_gil():
                bundle = self._dump("hang", fault={"kind": "hang", "where": where})
            if bundle is not None:
                self._stall = (progress(self.recorder), bundle)
            if not asked:
                self._ask_peers(bundle, where)
            if self.hang_action == "abort":
                os.abort()
            last = progress(self.recorder)  # our own marker is not progress

    # -- requests (recorder.requests) ----------------------------------------------------------
    def _snapshot(self, request: Request) -> dict[str, Any]:
        """A ``snapshot`` request, on the watcher's thread: a bundle now (the run goes on), unless this rank's bundle
        of the same stall answers a peer's hang request already."""
        recorder = self.recorder
        hang = request.params.get("reason") == "hang"
        stall = self._stall
        if hang and stall is not None and stall[0] == progress(recorder):
            return {"bundle": stall[1], "note": "this rank's bundle of the same stall"}
        if not recorder.wait_idle(_SNAPSHOT_WAIT_S):
            return {"error": f"another dump is under way on this rank (waited {_SNAPSHOT_WAIT_S} s)"}
        reason = "peer_hang" if hang else "snapshot"
        detail = request.params.get("where")
        where = f"asked by {request.asked_by}" + (f": {detail}" if isinstance(detail, str) and detail else "")
        with _eager_gil():
            path = recorder.dump(reason, fault={"kind": reason, "where": where, "request": request.id})
        if path is None:
            return {"error": "the recorder is stopping"}
        if hang:
            self._stall = (progress(recorder), path)
        answer: dict[str, Any] = {"bundle": path}
        try:
            manifest = read_json(os.path.join(path, "manifest.json"), what="an RDR manifest")
            answer.update(step=manifest.get("step"), now=manifest.get("now"))
        except (OSError, ValueError) as exc:  # the bundle is there; the answer only goes without its summary
            report_internal_error("rdr requests: reading back a snapshot's manifest", exc)
        return answer

    def _ask_peers(self, bundle: str | None, where: str) -> None:
        """After this rank's hang bundle: a ``snapshot`` request (reason ``hang``) to every other rank, answered here
        with this rank's own bundle; with ``hang_action`` abort, wait a little for the peers' answers."""
        watcher, recorder = self._requests, self.recorder
        if watcher is None or recorder.world_size < 2:
            return
        rank = recorder.rank
        try:
            request = make_request("snapshot", asked_by=f"rank {rank}",
                                   params={"reason": "hang", "where": where, "step": recorder.step})
            watcher.ignore(request)
            write_request(self.root, request)
            self._asked.append(request)
            write_answer(watcher.folder, request, rank, {"bundle": bundle} if bundle else
                         {"error": "this rank's hang dump failed"})
        except OSError as exc:
            report_internal_error("rdr requests: asking the peers on a hang", exc)
            return
        if self.hang_action == "abort":
            deadline = time.monotonic() + _PEERS_WAIT_S
            while time.monotonic() < deadline and _answered(watcher.folder, request) < recorder.world_size:
                time.sleep(0.1)

    def end(self, *, stopping: bool = True) -> None:
        """The recording ends: its last bundle, if it owes one (:meth:`Recorder.end_dump`).  ``stopping``: the
        process ends or the recorder is turned off (``reset_context``, the env config file), so mode 2 writes
        ``normal_end`` unless an exception or a signal ended the run; False: it restarts on a new layout, and only
        a fault no bundle holds is written (its ring is about to go)."""
        try:
            self.recorder.end_dump(normal_end=stopping and self.mode == 2 and not self.abnormal)
        except Exception as exc:  # noqa: BLE001 - a failed dump must not change how the process ends
            report_internal_error("rdr dump (end of the recording)", exc)

    def _at_exit(self) -> None:
        self.end()
        self.uninstall()
        self.recorder.close(clean_exit=True)


_EAGER_LOCK = threading.Lock()
_eager: list[float] = []  # the interval before the first of the dumps under way, then one entry per dump


@contextlib.contextmanager
def _eager_gil() -> Iterator[None]:
    """A dump off the main thread while the main thread runs Python (a user's loop: what snapshots and hangs catch)
    waits a whole switch interval for the GIL after each of its system calls: seconds in all on a busy machine
    (measured: 0.3 s to 11 s on 2 busy cores).  A shorter interval for the dump's duration only."""
    with _EAGER_LOCK:
        if not _eager:
            _eager.append(sys.getswitchinterval())
            sys.setswitchinterval(min(_eager[0], _DUMP_SWITCH_S))
        _eager.append(0.0)  # one per dump inside: the first entry is the interval to restore after the last
    try:
        yield
    finally:
        with _EAGER_LOCK:
            _eager.pop()
            if len(_eager) == 1:
                sys.setswitchinterval(_eager.pop())


def _answered(folder: str, request: Request) -> int:
    """How many answers ``request`` has (the files: cheap, nothing read)."""
    try:
        return sum(1 for name in os.listdir(folder) if name.startswith(f"{request.name}.rank_"))
    except OSError:
        return 0


def _give_faulthandler_back() -> None:
    """Enable faulthandler again, as it was before the recorder took it: on ``sys.stderr``, or where that has no
    file descriptor (pytest's capture, a notebook), on the process's own stderr; else leave it off."""
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None:  # no stderr at all (pythonw, a daemon)
            continue
        try:
            faulthandler.enable(stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # no fileno(): io.UnsupportedOperation is both of the last two
            continue

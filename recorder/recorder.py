"""The Running Data Recorder: bus events → the memory-mapped ring; faults → bundles.

Recording is O(1) per event and does no I/O: each handler interns its strings (once per
distinct string) and packs one slot into the shared map.  ``granularity`` decides which
events are subscribed at all: ``off`` (faults, prints, settings, graphs only), ``step`` (+ steps,
phases, memory, collectives), ``module`` (+ module enter/exit), ``op`` (+ every aten op).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from obs._core import outputs, safe_files
from obs._core.events import Event
from obs._core.internal import report_internal_error
from obs._core.json_files import read_json
from obs._core.rank_folders import rank_folder
from recorder.assemble import bundle_parts
from recorder.bundle import bundle_name, write_bundle
from recorder.collective_desc import COLLECTIVE_STATES, collective_desc
from recorder.graph_texts import remove_graphs, write_graph
from recorder.layout import DEFAULT_CAPACITY, PHASE_CODES, Kind
from recorder.now import now
from recorder.ring import RingWriter
from recorder.ring_handlers import RingSubscriptions
from recorder.ring_reader import RingContents, read_ring
from recorder.shared_root import leave, make
from recorder.stacks import all_stacks

__all__ = ["GRANULARITIES", "RdrConfig", "Recorder", "rdr_dir"]

GRANULARITIES = ("off", "step", "module", "op")
_GRAPHS_KEPT = 32
_CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class RdrConfig:
    """What the recorder does; built by ``obs`` from env config + context."""

    path: str
    mode: int = 1
    granularity: str = "module"
    capacity: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_CAPACITY))
    op_timeout: int = 900
    hang_action: str = "dump"


#: byte offset of (rank, world_size) in the ring header (layout.HEADER: magic, version, pid, rank, world_size, ...)
_RANK_AT = struct.calcsize("<8sII")


def rdr_dir(path: str, rank: int, *, pending_pid: int | None = None) -> str:
    """``{path}/rank_{rank}/rdr`` (MindSpore's layout; an unset path is the current folder).

    ``pending_pid``: the rank is not known yet (a launcher gave no ``RANK``: ``torch.multiprocessing.spawn``,
    Lightning's; before ``init_process_group``): ``rank_unresolved-{pid}/rdr``, one folder per process, until it is.
    """
    return os.path.join(path or os.getcwd(), rank_folder(rank, unresolved_pid=pending_pid), "rdr")


class Recorder:
    """Owns one ring file and the subscriptions feeding it; ``dump()`` writes a bundle."""

    def __init__(self, config: RdrConfig, *, rank: int, world_size: int, run_id: str,
                 settings: Callable[[], dict[str, Any]], versions: dict[str, str], rank_known: bool = True) -> None:
        """``rank_known``: False while the rank is a guess (the ring is kept under ``rank_unresolved-{pid}`` until
        :meth:`resolve_rank`)."""
        self.config = config
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.rank_known = rank_known
        #: called before a bundle is written: (rank, world size) once torch.distributed knows them, else None
        self.identity: Callable[[], tuple[int, int] | None] | None = None
        self._settings = settings
        self._versions = versions
        self._root = config.path or os.getcwd()
        self.dir = rdr_dir(config.path, rank, pending_pid=None if self.rank_known else self.pid)
        self._created = make(self.dir, self._root)  # removed again on a clean exit with nothing to report
        try:
            self.ring = RingWriter(os.path.join(self.dir, f"ring_{self.pid}.obsring"), dict(config.capacity),
                                   pid=self.pid, rank=rank, world_size=world_size,
                                   meta={"run_id": run_id, "host": self.host, "granularity":
                                         config.granularity, "argv": sys.argv[:8], "versions": versions})
        except BaseException:
            leave(self._created, self._root)  # a recorder that could not start leaves no folder behind
            raise
        self.fatal_path = os.path.join(self.dir, f"fatal_{self.pid}.txt")
        self.step = 0
        self.dumps: list[str] = []
        self.failed: str | None = None  #: why the last dump failed (the ring is then kept for recover)
        self._faults = 0  # faults recorded that no bundle covered when they came
        self._unreported: tuple[int, dict[str, Any]] | None = None  # the newest of them (number, record)
        self._reported = 0  # the faults (by number) the last bundle holds
        self.graphs: deque[tuple[str, str]] = deque(maxlen=_GRAPHS_KEPT)
        self._graph_files: list[str] = []  # beside the ring, oldest first
        self._graphs_seen = 0
        self._dump_lock = threading.Lock()
        self._dumping: int | None = None  # ident of the thread inside dump(), read without the lock
        self._subs = RingSubscriptions(self.ring)
        #: called with a bundle's files before they are written: adds what others recorded (PyTorch's Flight Recorder)
        self.amend_files: Callable[[dict[str, Any]], Any] | None = None
        self._subscribe()
        self.mark("running")

    # -- subscriptions ------------------------------------------------------------------------
    def _subscribe(self) -> None:
        level = GRANULARITIES.index(self.config.granularity)
        subs = self._subs
        add = subs.add
        add(Event.PRINT, self._on_print)
        add(Event.FAULT, self._on_fault)
        add(Event.SETTINGS_CHANGED, self._on_settings)
        add(Event.GRAPH_COMPILED, self._on_graph)
        add(Event.GRAPH_IR, self._on_graph_ir)
        if level >= 1:
            step, memory, collective = subs.appender("step"), subs.appender("memory"), subs.appender("collective")
            intern, ids = self.ring.intern, self.ring.ids

            def on_step_begin(number: int) -> None:
                self.step = number
                subs.step_begins(number)
                step(Kind.STEP_BEGIN, 0, 0, number, 0, 0)

            def on_step_end(number: int, duration_ns: int) -> None:
                step(Kind.STEP_END, 0, 0, number, duration_ns, 0)

            seen: list[Any] = [None, 0, 0, 0]  # the last stats dict and its slot's values (the CPU's repeats)

            def on_memory(number: int, stats: dict[str, Any]) -> None:
                if stats is not seen[0]:
                    used = stats.get("allocated_bytes.all.current", stats.get("rss_bytes", 0))
                    other = stats.get("reserved_bytes.all.current", stats.get("vms_bytes", 0))
                    name = str(stats.get("device", "?"))
                    device = ids.get(name)
                    if device is None:
                        device = intern(name)
                    seen[:] = stats, device, int(used), int(other)
                memory(Kind.MEMORY, 0, seen[1], number, seen[2], seen[3])
                if "allocated_bytes.all.peak" in stats:  # CUDA: the step's peaks (the counters are reset per step)
                    memory(Kind.MEMORY_PEAK, 0, seen[1], number, int(stats["allocated_bytes.all.peak"]),
                           int(stats.get("reserved_bytes.all.peak", 0)))

            def on_phase(name: str, begin_ns: int, end_ns: int) -> None:
                step(Kind.PHASE, 0, PHASE_CODES.get(name, 9), self.step, begin_ns, end_ns)

            def on_collective(record: dict[str, Any]) -> None:
                desc = intern(collective_desc(record))
                state = COLLECTIVE_STATES.index(record.get("state", "completed"))
                collective(Kind.COLLECTIVE, 1 if record.get("error") else 0, desc, int(record.get("seq", 0)),
                           int(record.get("duration_ns", 0)), state)

            add(Event.STEP_BEGIN, on_step_begin)
            add(Event.STEP_END, on_step_end)
            add(Event.MEMORY, on_memory)
            add(Event.COLLECTIVE, on_collective)
            add(Event.PHASE, on_phase)  # where each step's time went: the doctor's stragglers by phase
        if level >= 2:
            subs.modules(self)
        if level >= 3:
            subs.ops(native=True)

    # -- low-rate events (blobs) --------------------------------------------------------------
    def _on_print(self, values: Any, meta: Any) -> None:
        if self.ring.closed:  # an emit that took its snapshot of handlers before we unsubscribed
            return
        shown = [v if isinstance(v, str) else _tensor_summary(v) for v in values]
        self.ring.blob(Kind.PRINT, {"values": shown, "step": meta.step, "source": meta.source})

    def _on_settings(self, source: str, changes: Any) -> None:
        if self.ring.closed:
            return
        self.ring.blob(Kind.SETTINGS, {"source": source, "changes": {k: list(v) for k, v in changes.items()}})

    def _on_graph(self, name: str, graph_module: Any, example_inputs: Any) -> None:
        if self.ring.closed:
            return
        self.ring.blob(Kind.GRAPH, {"name": name, "nodes": len(getattr(getattr(graph_module, "graph", None),
                                                                         "nodes", ()))})

    def _on_graph_ir(self, name: str, stage: str, text: str) -> None:
        """Keep the graph's ``.ir`` text for bundles, and beside the ring (``graphs_{pid}/``) for ``recover``."""
        if self.ring.closed:
            return
        self.graphs.append((f"{stage}_{name}", text))
        self._graph_files.append(write_graph(self.graphs_dir, self._graphs_seen, f"{stage}_{name}", text))
        self._graphs_seen += 1
        while len(self._graph_files) > _GRAPHS_KEPT:
            try:
                os.unlink(self._graph_files.pop(0))
            except OSError:
                pass

    @property
    def graphs_dir(self) -> str:
        return os.path.join(self.dir, f"graphs_{self.pid}")

    def _on_fault(self, kind: str, detail: Any, error: Any) -> None:
        if self.ring.closed:
            return
        record = {"fault": kind, "detail": str(detail)}
        if isinstance(error, BaseException):
            record.update(error=f"{type(error).__name__}: {error}")
        elif error is not None and str(error):  # a fault without an exception may say what it found
            record.update(error=str(error))
        self.ring.blob(Kind.FAULT, record)
        # KeyboardInterrupt, SystemExit: the signal's or the exit's, dumped (or not) as such; an error already in
        # a bundle (an enclosing module sees it again): that bundle is the fault's
        if isinstance(error, BaseException) and (not isinstance(error, Exception)
                                                 or getattr(error, "_obs_rdr_dumped", False)):
            return
        self._faults += 1
        self._unreported = (self._faults, record)
        if kind in ("module_error", "op_error") and isinstance(error, Exception):
            self.dump(kind, error=error, fault={"kind": kind, "where": str(detail)})

    @property
    def unreported_fault(self) -> dict[str, Any] | None:
        """The newest fault recorded since the last bundle (``fault``, ``detail``, maybe ``error``), or None."""
        pending = self._unreported
        return pending[1] if pending is not None and pending[0] > self._reported else None

    def end_dump(self, *, normal_end: bool) -> str | None:
        """The recording ends (the process, ``reset_context``, the recorder turned off): write the bundle it still
        owes, and return its path.  A fault no bundle holds (a NaN/Inf found with ``action: continue``) is one,
        named for the fault, in every mode; else ``normal_end`` when asked (mode 2, a run that ended normally).
        None when there is nothing to write."""
        fault = self.unreported_fault
        if fault is not None:
            return self.dump(str(fault["fault"]), fault={"kind": fault["fault"], "where": fault["detail"],
                                                         **({"error": fault["error"]} if "error" in fault else {})})
        if normal_end:
            return self.dump("normal_end")
        return None

    def marker(self, name: str, **payload: Any) -> None:
        """Record a low-rate marker (signals, hangs) in the ring."""
        if self.ring.closed:
            return
        self.ring.blob(Kind.MARKER, {"marker": name, **payload})

    # -- dumps --------------------------------------------------------------------------------
    def dump(self, reason: str, *, error: BaseException | None = None, fault: dict[str, Any] | None = None,
             stacks: str | None = None) -> str | None:
        """Write a bundle now; returns its path.

        None when the exception was already dumped, or when this thread is already inside a dump (a
        signal handler that ran in the middle of one): a dump is never re-entered and its lock is
        never taken twice by one thread.
        """
        me = threading.get_ident()
        if self._dumping == me:
            return None
        if error is not None:
            if getattr(error, "_obs_rdr_dumped", False):
                return None
            try:
                error._obs_rdr_dumped = True  # type: ignore[attr-defined]
            except AttributeError:
                pass
        self._follow_identity()
        pointer = getattr(error, "_obs_exception_dump", None)  # the exception dump of the same fault
        if pointer:
            fault = {**(fault or {}), "exception_dump": pointer}
        with self._dump_lock:
            self._dumping = me
            try:
                if self.ring.closed:
                    return None
                faults = self._faults  # those the ring holds now: a fault after this read is not in the bundle
                contents = read_ring(self.ring.buffer())
                path = self._write(reason, contents, error=error, fault=fault, stacks=stacks)
                self._reported = max(self._reported, faults)
                return path
            finally:
                self._dumping = None

    def dumping_here(self) -> bool:
        """Whether the calling thread is inside :meth:`dump`."""
        return self._dumping == threading.get_ident()

    def busy(self) -> bool:
        """Whether a dump is under way (on any thread)."""
        return self._dump_lock.locked()

    def wait_idle(self, timeout: float) -> bool:
        """Wait (from a thread that is not dumping) until no dump is under way; False on timeout."""
        if self.dumping_here():
            return False
        if not self._dump_lock.acquire(timeout=max(0.0, timeout)):
            return False
        self._dump_lock.release()
        return True

    def stop_dumps(self, timeout: float) -> bool:
        """The process is ending: wait until no dump is under way, then keep the dump lock so that none starts
        (a caller of :meth:`dump` waits for the end; a dump cut short would leave only its temporary folder).
        False when ``timeout`` ran out first."""
        if self.dumping_here():
            return False
        return self._dump_lock.acquire(timeout=max(0.0, timeout))

    def _write(self, reason: str, contents: RingContents, *, error: BaseException | None,
               fault: dict[str, Any] | None, stacks: str | None) -> str:
        manifest, files = bundle_parts(contents, reason, error=error, fault=fault, fatal_stacks=stacks,
                                       threads=all_stacks(), graphs=list(self.graphs),
                                       settings=self._safe_settings())
        try:
            manifest["now"] = now(contents)  # the step, module and collective the rank is in (obs rdr snapshot)
        except Exception as exc:  # noqa: BLE001 - the bundle goes out without it
            report_internal_error("RDR bundle: now", exc)
        if self.amend_files is not None:
            try:
                self.amend_files(files)
            except Exception as exc:  # noqa: BLE001 - the bundle goes out with what the ring holds
                report_internal_error("RDR bundle: amend_files", exc)
        try:
            path = write_bundle(self.dir, bundle_name(reason, contents.header.pid), manifest, files)
        except BaseException as exc:
            # The ring is the only copy of the evidence now: keep it, say why in the marker.
            self.failed = f"{reason}: {type(exc).__name__}: {exc}"
            self._mark_quietly("dump_failed", failed=self.failed, ring=os.path.basename(self.ring.path),
                               next_step="obs rdr recover retries the bundle from the ring")
            raise
        self.dumps.append(path)
        outputs.wrote("RDR bundle", path)
        self.failed = None
        self.mark("dumped", last_reason=reason, last_bundle=os.path.basename(path))
        return path

    def _safe_settings(self) -> dict[str, Any]:
        try:
            return self._settings()
        except Exception as exc:  # noqa: BLE001 - a settings bug must not cost the dump
            report_internal_error("rdr settings snapshot", exc)
            return {}

    def set_run_id(self, run_id: str) -> None:
        """The job's run id, agreed by the ranks once torch.distributed is up: in the ring (for bundles, recovered
        ones too) and in the marker."""
        if run_id == self.run_id or self.ring.closed:
            return
        self.run_id = run_id
        self.marker("run_id", run_id=run_id)
        state, extra = self._marked
        self._mark_quietly(state, **extra)

    def mark(self, state: str, **extra: Any) -> None:
        """The per-rank marker: whether and why this rank dumped."""
        self._marked = (state, extra)
        data = {"state": state, "pid": self.pid, "rank": self.rank, "world_size": self.world_size,
                "host": self.host, "run_id": self.run_id, "dumps": [os.path.basename(p) for p in self.dumps],
                "updated_ns": time.time_ns(), **extra}
        safe_files.write_atomic(os.path.join(self.dir, "marker.json"), json.dumps(data, indent=2, default=str))

    def _mark_quietly(self, state: str, **extra: Any) -> None:
        try:
            self.mark(state, **extra)
        except OSError:  # the disk that failed the dump may fail this too; the ring still tells
            pass

    # -- rank -----------------------------------------------------------------------------------
    def _follow_identity(self) -> None:
        """Before a bundle: the rank torch.distributed gives, if it differs from the recorder's (a fault before the
        step boundary that would have moved it)."""
        if self.identity is None:
            return
        try:
            found = self.identity()
            if found is not None and (not self.rank_known or found != (self.rank, self.world_size)):
                self.resolve_rank(*found)
        except Exception as exc:  # noqa: BLE001 - the bundle goes out under the rank it has
            report_internal_error("RDR rank before a bundle", exc)

    def resolve_rank(self, rank: int, world_size: int) -> bool:
        """``init_process_group`` ran: this process is ``rank`` of ``world_size``, whatever the recorder guessed.
        Moves the ring (with its marker and graphs) under ``rank_{rank}`` and puts both in the ring's header and the
        marker.  False when a dump under way defers it (called again at the next step boundary)."""
        if self.ring.closed:
            return True
        if self.rank_known and (rank, world_size) == (self.rank, self.world_size):
            return True
        if not self._dump_lock.acquire(blocking=False):
            return False
        try:
            self._relocate(rank, world_size)
        finally:
            self._dump_lock.release()
        return True

    def _relocate(self, rank: int, world_size: int) -> None:
        old_dir, old_created = self.dir, self._created
        new_dir = rdr_dir(self.config.path, rank)
        if new_dir != old_dir:
            created = make(new_dir, self._root)
            ring_path = os.path.join(new_dir, os.path.basename(self.ring.path))
            fatal_path = os.path.join(new_dir, os.path.basename(self.fatal_path))
            os.rename(self.ring.path, ring_path)  # the map stays valid: it maps the file, not the name
            self.ring.path = ring_path
            if os.path.lexists(self.fatal_path):
                os.rename(self.fatal_path, fatal_path)  # faulthandler writes through its open descriptor
            if os.path.isdir(self.graphs_dir):
                old_graphs = self.graphs_dir
                os.rename(old_graphs, os.path.join(new_dir, os.path.basename(old_graphs)))
                self._graph_files = [os.path.join(new_dir, os.path.basename(old_graphs), os.path.basename(f))
                                     for f in self._graph_files]
            self.fatal_path = fatal_path
            self.dir, self._created = new_dir, created
        # Published in the ring's header so recover names the right rank.
        self.ring.buffer()[_RANK_AT:_RANK_AT + 8] = rank.to_bytes(4, "little") + world_size.to_bytes(4, "little")
        self.rank, self.world_size, self.rank_known = rank, world_size, True
        state, extra = self._marked
        self.mark(state, **extra)
        if new_dir != old_dir:
            _unlink_marker(old_dir, self.pid)
            leave(old_created, self._root)

    # -- lifecycle ----------------------------------------------------------------------------
    def _unsubscribe(self) -> None:
        self._subs.close()

    def detach(self) -> None:
        """In a forked child: stop recording without touching the parent's ring, marker or files.

        The child shares the parent's memory map; writing or closing it from the child would
        corrupt or delete the parent's record.
        """
        self._unsubscribe()
        self.ring.abandon()  # the child's copy of the map goes with the process; never unlink

    def close(self, *, clean_exit: bool = True, state: str = "exited") -> None:
        """Unsubscribe and close the ring; on a clean exit, tidy up (see :meth:`finish`)."""
        if self.ring.closed:
            return
        self._unsubscribe()
        self.wait_idle(_CLOSE_WAIT_S)  # a dump on another thread (a signal's) reads the map: let it finish
        keep = not clean_exit or self.failed is not None
        self.ring.close(remove=not keep)
        if clean_exit:
            self.finish(state, ring_removed=not keep)

    def finish(self, state: str, *, ring_removed: bool) -> None:
        """The files of a process that is ending (the map may still be open: the process dies next).

        * a dump failed, or the ring could not be removed: the ring stays for ``obs rdr recover``,
          and the marker says why;
        * something was reported (a bundle, a signal): the marker says ``state``;
        * nothing to report: nothing is left behind: no ring, no marker, no folder obs created.
        """
        if not ring_removed:
            self._mark_quietly("dump_failed" if self.failed else state, failed=self.failed,
                               ring=os.path.basename(self.ring.path),
                               next_step="obs rdr recover makes a bundle from the ring")
            outputs.wrote("RDR marker", os.path.join(self.dir, "marker.json"))
            return
        try:
            if os.path.getsize(self.fatal_path) == 0:
                os.unlink(self.fatal_path)
        except OSError:
            pass
        remove_graphs(self.graphs_dir)  # the ring is gone: nothing will recover them
        if self.dumps or state != "exited":
            self._mark_quietly(state, dumped=bool(self.dumps))
            outputs.wrote("RDR marker", os.path.join(self.dir, "marker.json"))
            return
        _unlink_marker(self.dir, self.pid)
        leave(self._created, self._root)

    def remove_ring(self) -> bool:
        """Unlink the ring file, keeping the map (the process is about to die); False if it failed."""
        try:
            os.unlink(self.ring.path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True


def _unlink_marker(folder: str, pid: int) -> None:
    """Remove this process's marker from ``folder``; not another's (a guessed rank 0 shared ``rank_0`` with the real
    one until torch.distributed told it otherwise)."""
    path = os.path.join(folder, "marker.json")
    try:
        if read_json(path, what="a rank's marker", limit=1 << 20).get("pid") != pid:
            return
        os.unlink(path)
    except (OSError, ValueError):
        pass


def _tensor_summary(item: Any) -> str:
    data = getattr(item, "data", None)
    dims = list(getattr(item, "dims", ()))
    if data is not None and data.size <= 8 and item.dtype != "BFloat16":
        return f"{item.dtype}{dims} {np.array2string(data, separator=', ')}"
    return f"{item.dtype}{dims}"

"""``obs rdr recover``: turn the ring of a process that died without dumping into a normal bundle.

A ring file outlives SIGKILL, OOM kills and segfaults; faulthandler's stacks of a fatal signal
sit next to it (``fatal_{pid}.txt``, pid from the ring's header).  A recovered ring is renamed
``*.recovered`` so it is recovered once.

Liveness: the writer holds an exclusive ``flock`` on its ring for as long as it runs and the kernel
releases it when the process dies, however it dies.  A ring whose lock can be taken has no writer;
recover keeps holding the lock while it converts the ring, so two recovers never make two bundles
of one ring.  No pid is ever signalled: a pid read from a file (or its name) may by now belong to
an unrelated process, or be a value planted to make us signal one.  (Where the file system has no
``flock``, the header's pid is looked up in ``/proc``: see :func:`writer_alive`.)

Every file is opened with :func:`obs._core.safe_files.open_private` (no symlink, a regular file of
this user).  A bad ring is reported and the others are still recovered.
"""

from __future__ import annotations

import fcntl
import glob
import os
from dataclasses import dataclass, field

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError, UnsafePathError
from obs._core.rank_folders import GLOB
from recorder.assemble import bundle_parts
from recorder.bundle import bundle_name, write_bundle, write_json_atomic
from recorder.graph_texts import read_graphs
from recorder.ring_reader import read_header_file, read_ring_file

__all__ = ["FATAL_LIMIT", "Recovery", "RingFile", "find_rings", "near", "recover", "recover_rings", "writer_alive"]

#: faulthandler's dump of all threads is a few KiB; more than this is not faulthandler's
FATAL_LIMIT = 1 << 20

#: what makes one ring unreadable or unrecoverable; anything else is a bug and propagates
RING_ERRORS = (DamagedFileError, NotOurFileError, UnsafePathError, OSError, ValueError)


@dataclass(frozen=True)
class RingFile:
    """A ring file found under a folder: its writer's pid (from the header), whether the writer still
    runs, and ``error`` when the file cannot be read (then ``pid`` is -1)."""

    path: str
    pid: int
    alive: bool
    error: Exception | None = None


@dataclass
class Recovery:
    """What :func:`recover` did: the bundles it made and what it could not recover (each error names its file)."""

    made: list[str] = field(default_factory=list)
    problems: list[Exception] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)  #: rings left alone because their writer runs


#: where RDR files sit relative to what a user passes: an rdr folder, a rank folder, an RDR root,
#: or a folder of runs each with its root (bounded globs: never a walk of a whole tree)
_LEVELS = ("", "rdr", f"{GLOB}/rdr", f"*/{GLOB}/rdr", f"*/*/{GLOB}/rdr")


def near(path: str, pattern: str) -> list[str]:
    """Files or folders matching ``pattern`` at the RDR levels under ``path``, sorted."""
    base = glob.escape(path)
    return sorted({f for level in _LEVELS for f in glob.glob(os.path.join(base, level, pattern))})


def writer_alive(fd: int, pid: int, *, keep: bool = False) -> bool:
    """Whether the process that wrote the ring open as ``fd`` still holds it (its ``flock``).

    When it does not, the lock is now ours: ``keep`` holds it (until ``fd`` is closed), else it is
    released at once.  On a file system without ``flock`` the writer could not lock either: then a
    ring counts as alive while a process ``pid`` (the header's) exists, checked in ``/proc``, without
    signalling it (a reused pid only keeps a dead ring waiting, never the reverse)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock here (some network and FUSE file systems)
        return pid > 0 and os.path.exists(f"/proc/{pid}")
    if not keep:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _candidates(path: str) -> list[str]:
    return [path] if os.path.isfile(path) or os.path.islink(path) else near(path, "ring_*.obsring")


def find_rings(path: str) -> list[RingFile]:
    """Ring files under ``path`` (or ``path`` itself), with whether their writer is still alive.

    A file that cannot be read is listed with its ``error``; the others are still listed."""
    out = []
    for ring in _candidates(path):
        try:
            fd = safe_files.open_private(ring)
            try:
                header = read_header_file(ring, fd=fd)
                out.append(RingFile(ring, header.pid, writer_alive(fd, header.pid)))
            finally:
                os.close(fd)
        except RING_ERRORS as exc:
            out.append(RingFile(ring, -1, False, exc))
    return out


def recover(path: str) -> Recovery:
    """Bundles (reason ``recovered``, or ``fatal_signal`` when faulthandler left stacks) for every ring under
    ``path`` whose writer is gone.  One bad ring is reported in ``problems`` and the others go on."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no such rdr folder or ring file: {path!r}")
    result = Recovery()
    for ring in _candidates(path):
        try:
            bundle = _recover_one(ring)
        except RING_ERRORS as exc:
            result.problems.append(exc)
            continue
        if bundle is None:
            result.alive.append(ring)
            continue
        made, problem = bundle
        result.made.append(made)
        if problem is not None:
            result.problems.append(problem)
    return result


def recover_rings(path: str) -> list[str]:
    """:func:`recover`, returning the bundles made; after recovering every ring it can, raises the first problem."""
    result = recover(path)
    if result.problems:
        raise result.problems[0]
    return result.made


def _recover_one(ring: str) -> tuple[str, Exception | None] | None:
    """The bundle made of ``ring`` and a problem with its fatal-signal file (None: the writer is alive)."""
    fd = safe_files.open_private(ring)
    try:
        if writer_alive(fd, read_header_file(ring, fd=fd).pid, keep=True):
            return None
        contents = read_ring_file(ring, fd=fd)
        pid = contents.header.pid
        folder = os.path.dirname(ring)
        fatal_path = os.path.join(folder, f"fatal_{pid}.txt")
        fatal = ""
        problem: Exception | None = None
        if os.path.lexists(fatal_path):
            try:
                fatal = safe_files.read_private(fatal_path, limit=FATAL_LIMIT).decode("utf-8", "replace")
            except (UnsafePathError, OSError) as exc:
                problem = exc  # the ring is still recovered; the refused file is neither read nor renamed
        reason = "fatal_signal" if fatal.strip() else "recovered"
        fault = {"kind": reason, "where": _first_line(fatal) or "process ended without dumping (SIGKILL, OOM kill?)"}
        if problem is not None:
            fault["fatal_stacks_refused"] = str(problem)
        graphs_dir = os.path.join(folder, f"graphs_{pid}")
        graphs, refused = read_graphs(graphs_dir)  # the graph texts the recorder kept beside its ring
        if refused and problem is None:
            problem = refused[0]
        manifest, files = bundle_parts(contents, reason, fault=fault, fatal_stacks=fatal or None, recovered=True,
                                       graphs=graphs)
        bundle = write_bundle(folder, bundle_name(reason, pid), manifest, files)
        os.rename(ring, ring + ".recovered")  # only once the bundle is on disk (write_bundle fsyncs)
        if graphs and not os.path.islink(graphs_dir):
            os.rename(graphs_dir, graphs_dir + ".recovered")
        if fatal and problem is None:
            os.rename(fatal_path, fatal_path + ".recovered")
        write_json_atomic(os.path.join(folder, "marker.json"), {
            "state": "recovered", "pid": pid, "rank": contents.header.rank,
            "run_id": contents.header.meta.get("run_id"), "dumps": [os.path.basename(bundle)],
            "last_reason": reason, "last_bundle": os.path.basename(bundle)})
        return bundle, problem
    finally:
        os.close(fd)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""

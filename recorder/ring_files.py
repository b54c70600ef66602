"""The ring files under a folder, and which of them a running process still writes: the one search behind ``obs rdr
recover``, ``obs rdr ls``, ``obs top``, ``obs rdr snapshot`` and ``obs trace capture``.

Two kinds of ring sit in rank folders (:mod:`obs._core.rank_folders`): the RDR's,
``{root}/rank_{r}/rdr/ring_{pid}.obsring`` (:data:`RDR_RINGS`), and the profiler's,
``{output}/rank_{r}/profile_{pid}_{n}.obsring`` (:data:`PROFILE_RINGS`).  A user may pass the root, a rank or rdr
folder, a folder of runs each with its root, or a ring file.

Liveness: the writer holds an exclusive ``flock`` on its ring for as long as it runs and the kernel releases it when
the process dies, however it dies.  A ring whose lock can be taken has no writer.  No pid is ever signalled: a pid
read from a file (or its name) may by now belong to an unrelated process, or be a value planted to make us signal
one.  (Where the file system has no ``flock``, the header's pid is looked up in ``/proc``: see
:func:`writer_alive`.)  Every file is opened with :func:`obs._core.safe_files.open_private` (no symlink, a regular
file of this user).
"""

from __future__ import annotations

import fcntl
import glob
import os
from dataclasses import dataclass

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError, UnsafePathError
from obs._core.rank_folders import GLOB
from recorder.ring_reader import read_header_file

__all__ = ["PROFILE_RINGS", "RDR_RINGS", "RING_ERRORS", "LiveRank", "RingFile", "RingPlace", "candidates",
           "find_rings", "live_ranks", "near", "writer_alive"]

#: what makes one ring unreadable or unrecoverable; anything else is a bug and propagates
RING_ERRORS = (DamagedFileError, NotOurFileError, UnsafePathError, OSError, ValueError)


@dataclass(frozen=True)
class RingPlace:
    """Where one kind of ring sits: its files' ``pattern``, the ``levels`` searched under what a user passes (bounded
    globs: never a walk of a whole tree), and the ``depth`` of folders between its root and the ring's folder."""

    pattern: str
    levels: tuple[str, ...]
    depth: int

    def root(self, ring: str) -> str:
        """The root of ``ring``: the folder its job's requests go to (the RDR root, the profiler's output folder)."""
        folder = os.path.dirname(os.path.abspath(ring))
        for _ in range(self.depth):
            folder = os.path.dirname(folder)
        return folder


RDR_RINGS = RingPlace("ring_*.obsring", ("", "rdr", f"{GLOB}/rdr", f"*/{GLOB}/rdr", f"*/*/{GLOB}/rdr"), depth=2)
PROFILE_RINGS = RingPlace("profile_*.obsring", ("", GLOB), depth=1)


@dataclass(frozen=True)
class RingFile:
    """A ring file found under a folder: its writer's pid, rank and host (from the header), whether the writer still
    runs, and ``error`` when the file cannot be read (then ``pid`` and ``rank`` are -1)."""

    path: str
    pid: int
    alive: bool
    error: Exception | None = None
    rank: int = -1
    host: str | None = None


@dataclass(frozen=True)
class LiveRank:
    """A process whose ring is under the folder searched and whose writer runs: the root its requests go to, its
    ring, rank, host and pid."""

    root: str
    ring: str
    rank: int
    host: str
    pid: int


def near(path: str, pattern: str, place: RingPlace = RDR_RINGS) -> list[str]:
    """Files or folders matching ``pattern`` at ``place``'s levels under ``path``, sorted."""
    base = glob.escape(path)
    return sorted({f for level in place.levels for f in glob.glob(os.path.join(base, level, pattern))})


def candidates(path: str, place: RingPlace = RDR_RINGS) -> list[str]:
    """``path`` when it is a file, else the files named like ``place``'s rings under it."""
    return [path] if os.path.isfile(path) or os.path.islink(path) else near(path, place.pattern, place)


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


def find_rings(path: str, place: RingPlace = RDR_RINGS) -> list[RingFile]:
    """The rings of ``place`` under ``path`` (or ``path`` itself), with whether their writer is still alive.

    A file that cannot be read is listed with its ``error``; the others are still listed."""
    out = []
    for ring in candidates(path, place):
        try:
            fd = safe_files.open_private(ring)
            try:
                header = read_header_file(ring, fd=fd)
                host = header.meta.get("host")
                out.append(RingFile(ring, header.pid, writer_alive(fd, header.pid), rank=header.rank,
                                    host=host if isinstance(host, str) else None))
            finally:
                os.close(fd)
        except RING_ERRORS as exc:
            out.append(RingFile(ring, -1, False, exc))
    return out


def live_ranks(path: str, place: RingPlace = RDR_RINGS) -> list[LiveRank]:
    """The processes writing a ring of ``place`` under ``path`` now, sorted by root, rank and pid; a ring that
    cannot be read (ended and removed in between, not a ring after all) is not a live rank."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such folder: {path!r}")
    found = [LiveRank(place.root(r.path), r.path, r.rank, r.host or "?", r.pid)
             for r in find_rings(path, place) if r.alive and r.error is None]
    return sorted(found, key=lambda r: (r.root, r.rank, r.pid))

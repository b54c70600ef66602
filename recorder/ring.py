"""The writer of a ring file: O(1) appends into a shared memory map, no syscall, no lock.

Per kind, the slot fields mean:

==============  =========  ========  ===========  =============
kind            a          b         c            d
==============  =========  ========  ===========  =============
STEP_BEGIN      -          step      -            -
STEP_END        -          step      duration_ns  -
MODULE_ENTER    scope id   step      -            -
MODULE_EXIT     scope id   step      -            -
OP              name id    scope id  duration_ns  inputs id (shapes, dtypes, device)
MEMORY          device id  step      bytes used   bytes reserved (CUDA) / virtual (CPU)
COLLECTIVE      desc id    seq       duration_ns  state (0 scheduled, 1 started, 2 completed)
PHASE           phase      step      begin t_ns   end t_ns (phase: 0 data, 1 forward, 2 backward, 3 optimizer)
MEMORY_PEAK     device id  step      peak bytes   peak bytes reserved (CUDA: the step's peaks, allocated in c)
DEVICE_TIME     see below  see below see below    see below (``flags``: a ``layout.DeviceTarget``)
==============  =========  ========  ===========  =============

``flags`` bit 0 marks a module or op that raised; on a STEP_BEGIN of the profiler's ring it says the step is timed
on the device (``layout.STEP_TIMED``).

DEVICE_TIME slots (the profiler's ``device`` ring) are written off the training thread once the device has run
what they time; times are ns measured by the device, -1 where one could not be measured.  ``ref`` is the CUDA event
recorded at the step's begin:

=============  ==============  ===========================  =================================  ===============
target         a               b                            c                                  d
=============  ==============  ===========================  =================================  ===============
STEP           pairs skipped   step                         ref - the previous step's ref      end - ref
PHASE          phase           the PHASE slot's seq         start - ref (start: the mark       end - start
                                                            before: ref or the phase before)
MODULE         scope id        the MODULE_ENTER slot's seq  start - ref                        end - start
COLLECTIVE     op name id      step                         start - ref                        end - start
KERNEL         name id         step (of its launch)         start, wall-clock ns (CUPTI)       duration
KERNELS_BEGIN  -               the capture's first step     -                                  -
KERNELS_END    kernels left    the capture's last step      the capture's first step           kernels written
               out                                                                             (-1: it failed)
=============  ==============  ===========================  =================================  ===============

Strings (scopes, op names, signatures) are interned once into the file's string table, so the
reader can name everything after the writer is gone.  Threads append concurrently: ``next()``
on a counter is atomic (a C ``Counter`` with the hot path built, else an ``itertools.count``
under the GIL) and each append owns its slot.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from obs._core import safe_files
from recorder.hotpath import hotpath
from recorder.layout import BLOB, BLOB_SIZE, SLOT, STRINGS_USED_AT, Header, Kind, check_capacity, plan

__all__ = ["RingWriter", "SlotTarget"]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class SlotTarget(NamedTuple):
    """Slot ``idx`` of a ring lives at ``base + (idx % capacity) * size`` of ``mm``; write it with ``pack``."""

    pack: Any
    mm: mmap.mmap
    base: int
    capacity: int
    size: int
    counter: Iterator[int]
    seq: Iterator[int]
    clock: Any


class RingWriter:
    """Creates ``path`` through :mod:`obs._core.safe_files` (folders 0700, file 0600, never through a
    symlink, never over an existing file) and maps it.

    The writer holds an exclusive ``flock`` on the file for as long as it is open: the kernel drops it
    when the process dies, however it dies, so a reader tells a live ring from a dead one by trying
    the lock (:func:`recorder.ring_files.writer_alive`), never by signalling a pid.
    """

    def __init__(self, path: str, capacity: dict[str, int], *, pid: int, rank: int, world_size: int,
                 meta: dict[str, Any]) -> None:
        check_capacity(capacity)
        strings, blobs, rings, size = plan(capacity)
        fd = safe_files.create_file(path, read=True)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if isinstance(exc, BlockingIOError):
                    raise
                # No flock on this file system: readers fall back to the header's pid (see writer_alive).
            _check_free_space(fd, path, size)
            # Blocks reserved and pages mapped up front: the first write to a page of a sparse file
            # otherwise faults (block allocation) on the training thread.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot reserve {size} bytes for the ring file {path!r}: "
                                         f"{os.strerror(exc.errno or errno.EIO)}") from None
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                                   mmap.PROT_READ | mmap.PROT_WRITE)  # None once closed
            _populate_for_writing(self._mm)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        self._fd: int | None = fd  # kept open: it holds the liveness lock
        self.path = path
        self.header = Header(pid, rank, world_size, time.time_ns(), time.perf_counter_ns(), strings, 0, blobs,
                             rings, meta)
        encoded = self.header.encode()
        self._mm[:len(encoded)] = encoded
        self.ids: dict[str, int] = {}  #: interned text → id (read by the hot paths; written by intern())
        self._strings_at = strings.offset
        self._strings_end = strings.offset + strings.capacity
        self._strings_lock = threading.Lock()
        hot = hotpath()
        # With the C hot path, counters and the string table are C objects that the native op
        # observer (recorder/native_ops.py) also appends through, without the GIL.
        count = hot.Counter if hot is not None else itertools.count
        self.table = None if hot is None else hot.StringTable(self._mm, strings.offset, strings.capacity,
                                                               STRINGS_USED_AT)
        self.seq = count(1)
        self._blob_idx = count(0)
        self.blobs = blobs
        self._counters = {r.name: count(0) for r in rings}
        self.rings = {r.name: r for r in rings}
        self.intern("")  # id 0: no scope / unknown

    # -- strings ----------------------------------------------------------------------------
    def intern(self, text: str) -> int:
        """The id of ``text`` in the string table (appended on first use; -1 when the table is full)."""
        sid = self.ids.get(text)
        if sid is not None:
            return sid
        with self._strings_lock:
            sid = self.ids.get(text)
            if sid is not None:
                return sid
            data = text.encode("utf-8", "surrogatepass")
            if self.table is not None:
                appended: int = self.table.append(data)  # -1 when the table is full
                if appended >= 0:
                    self.ids[text] = appended
                return appended
            at = self._strings_at
            if at + 4 + len(data) > self._strings_end:
                return -1
            mm = self._mm
            assert mm is not None, "intern() on a closed ring"
            _U32.pack_into(mm, at, len(data))
            mm[at + 4:at + 4 + len(data)] = data
            self._strings_at = at + 4 + len(data)
            # Published after the bytes: a crash in between leaves the entry invisible, never torn.
            _U64.pack_into(mm, STRINGS_USED_AT, self._strings_at - self.header.strings.offset)
            sid = len(self.ids)
            self.ids[text] = sid
            return sid

    def recorded(self) -> int:
        """How many slots and blobs have been written so far (read without drawing a number)."""
        seq = self.seq
        if isinstance(seq, itertools.count):
            return int(repr(seq)[6:-1]) - 1  # its repr is "count(N)"
        return int(seq.value) - 1

    # -- slots ------------------------------------------------------------------------------
    def slots(self, ring: str) -> SlotTarget:
        """What a hot path needs to write a slot of ``ring`` itself, inline (see :meth:`appender`)."""
        region = self.rings[ring]
        assert self._mm is not None, "slots() of a closed ring"
        return SlotTarget(SLOT.pack_into, self._mm, region.offset, region.capacity, SLOT.size, self._counters[ring],
                          self.seq, time.perf_counter_ns)

    def appender(self, ring: str) -> Callable[[int, int, int, int, int, int], None]:
        """A fast ``append(kind, flags, a, b, c, d)`` bound to one ring (hot paths keep it in a local)."""
        pack, mm, base, cap, size, counter, seq, clock = self.slots(ring)

        def append(kind: int, flags: int, a: int, b: int, c: int, d: int) -> None:
            idx = next(counter)
            pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), kind, flags, a, b, c, d)

        return append

    # -- blobs ------------------------------------------------------------------------------
    def blob(self, kind: Kind, payload: dict[str, Any]) -> None:
        """Append a small JSON record (prints, faults, settings, markers); long text is cut to fit."""
        data = _fit(payload, BLOB_SIZE - BLOB.size)
        idx = next(self._blob_idx)
        at = self.blobs.offset + (idx % self.blobs.capacity) * BLOB_SIZE
        mm = self._mm
        assert mm is not None, "blob() on a closed ring"
        BLOB.pack_into(mm, at, 0, time.perf_counter_ns(), int(kind), len(data), idx + 1)
        mm[at + BLOB.size:at + BLOB.size + len(data)] = data
        _U64.pack_into(mm, at, next(self.seq))  # seq last: a half-written blob reads as empty

    # -- lifecycle --------------------------------------------------------------------------
    def buffer(self) -> mmap.mmap:
        """The live map (read it with :func:`recorder.ring_reader.read_ring`)."""
        assert self._mm is not None, "buffer() of a closed ring"
        return self._mm

    def abandon(self) -> None:
        """In a forked child: forget the parent's map without closing or unlinking anything.

        The child's copy of the descriptor is closed; the lock stays with the parent's."""
        self.table = None  # not released: its mutex may have been held by another thread at the fork
        self._mm = None
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self, *, remove: bool) -> None:
        if self.table is not None:
            self.table.release()
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        fd, self._fd = self._fd, None  # after the unlink: a reader never sees an unlocked live ring
        if fd is not None:
            os.close(fd)


#: madvise(MADV_POPULATE_WRITE), Linux >= 5.14 (not in Python's mmap module before 3.13)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate_for_writing(mm: mmap.mmap) -> None:
    """Take every page's first write fault now, not on the training thread.

    MAP_POPULATE maps a shared file's pages read-only (the kernel will not dirty them for nothing), so
    without this the first write to each 4 KiB of the ring faults into the file system (~2.5 µs here),
    and op recording, about two pages per step of a small MLP, paid it on every step of the ring's first
    pass.  Where the kernel lacks the advice (before 5.14), a write per page does the same."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return
    except (OSError, ValueError, AttributeError):
        pass
    for at in range(0, len(mm), mmap.PAGESIZE):
        mm[at] = mm[at]


def _check_free_space(fd: int, path: str, size: int) -> None:
    """Refuse, with a clear error, a ring larger than the free space of its file system."""
    info = os.fstatvfs(fd)
    free = info.f_bavail * info.f_frsize
    if size > free:
        raise OSError(errno.ENOSPC, f"not enough free disk space for the ring file {path!r}: it needs {size} bytes "
                                    f"({size / 2**20:.1f} MiB), the file system has {free} bytes "
                                    f"({free / 2**20:.1f} MiB) free; free some space, lower rdr capacity, or "
                                    "set rdr.path to another disk")


def _fit(payload: dict[str, Any], room: int) -> bytes:
    """JSON of ``payload`` in at most ``room`` bytes: the longest strings are shortened first."""
    payload = dict(payload)
    for _ in range(16):
        data = json.dumps(payload, separators=(",", ":"), default=str).encode()
        if len(data) <= room:
            return data
        key = max(payload, key=lambda k: len(str(payload[k])))
        text = str(payload[key])
        payload[key] = text[:max(0, len(text) - (len(data) - room) - 16)] + "…[cut]"
        payload["truncated"] = True
    return b'{"truncated":true}'

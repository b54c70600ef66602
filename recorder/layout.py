"""The ring file's format: a header page, a string table, a blob ring and fixed-slot event rings.

Everything is little-endian and written in place through a shared memory map, so what was
recorded is in the page cache the moment it is written and survives SIGKILL, an OOM kill or a
segfault of the process.  Pure: structs, codes and (de)serialisation of the header only.

::

    header   4096 B  magic, version, pid, rank, clocks, region table, JSON metadata
    strings          u32 length + UTF-8 bytes, append-only; ``strings_used`` is written last
    blobs            BLOB_SIZE-byte slots: seq, t_ns, kind, length, idx, JSON payload (prints, faults…)
    rings            one per ring kind, SLOT.size-byte slots: seq, idx, t_ns, kind, flags, a, b, c, d

A slot's ``seq`` is global (orders events across rings); ``idx`` counts within its ring, so
``max(idx) - capacity`` is what that ring dropped.  ``seq == 0`` marks a slot never written.
"""

from __future__ import annotations

import enum
import json
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BLOB", "BLOB_SIZE", "DEFAULT_CAPACITY", "HEADER", "HEADER_SIZE", "MAGIC", "MAX_RING_BYTES",
           "MONITOR_SLOT", "OPTIONAL_RINGS", "PHASE_CODES", "PHASE_NAMES", "RINGS", "SCALAR_SLOT", "SIDE_RINGS",
           "SLOT", "STEP_TIMED", "STRINGS_USED_AT", "VERSION", "DeviceTarget", "Header", "Kind", "Region",
           "check_capacity", "plan"]

MAGIC = b"OBSRING\x01"
VERSION = 1
HEADER_SIZE = 4096
STRINGS_SIZE = 4 << 20
BLOB_SIZE = 2048

#: seq, idx, t_ns, kind, flags, a, b, c, d
SLOT = struct.Struct("<QQqHHiqqq")
#: A SCALAR slot: SLOT's layout with ``d`` a float64 (the value), so a reader views ``d`` as ``<f8``
SCALAR_SLOT = struct.Struct("<QQqHHiqqd")
#: A MONITOR_ANOMALY slot: SLOT's layout with ``c`` and ``d`` float64 (the baseline and the value)
MONITOR_SLOT = struct.Struct("<QQqHHiqdd")
#: seq, t_ns, kind, length, idx (1-based count of blobs written)
BLOB = struct.Struct("<QqHHI")
#: magic, version, pid, rank, world_size, wall_ns, mono_ns, strings (off, cap, used), blobs (off, cap), n_rings
HEADER = struct.Struct("<8sIIIIqqQQQQQI")
REGION = struct.Struct("<16sQQ")  # ring name, offset, capacity
STRINGS_USED_AT = struct.calcsize("<8sIIIIqqQQ")  # byte offset of strings_used in the header


#: A PHASE slot's ``a``: the phase's code (its index here); a code outside the list reads as ``phase_{code}``.
PHASE_NAMES = ("data", "forward", "backward", "optimizer")
PHASE_CODES = {name: code for code, name in enumerate(PHASE_NAMES)}


class Kind(enum.IntEnum):
    """What a slot or blob records; the meaning of a, b, c, d per kind is in ``recorder.ring``."""

    STEP_BEGIN = 1
    STEP_END = 2
    MODULE_ENTER = 3
    MODULE_EXIT = 4
    OP = 5
    MEMORY = 6
    COLLECTIVE = 7
    PHASE = 8  # a phase of a step (data, forward, backward, optimizer) ended: written by the profiler's ring
    SCALAR = 9  # obs.scalar(name, value), in the profiler's ring: a name id, b step, d the value (SCALAR_SLOT)
    DEVICE_TIME = 10  # time on the device (CUDA events, CUPTI), in the profiler's ring: flags a DeviceTarget
    MEMORY_PEAK = 11  # the device's peak memory in a step, in the profiler's ring: c allocated, d reserved
    MONITOR_VALUE = 12  # a monitor series' value at a step (the ``monitor`` ring): a series id, b step, d the value
    MONITOR_ANOMALY = 13  # a value the monitor flagged (``monitor_anomaly``): a series+rule id, b step, c baseline,
    #                       d value (c and d float64: MONITOR_SLOT), flags the score as float16 bits
    PRINT = 20
    FAULT = 21
    SETTINGS = 22
    GRAPH = 23
    MARKER = 24


class DeviceTarget(enum.IntEnum):
    """What a DEVICE_TIME slot times: its ``flags`` (the meaning of a, b, c, d per target is in ``recorder.ring``)."""

    STEP = 1
    PHASE = 2
    MODULE = 3
    COLLECTIVE = 4
    KERNEL = 5
    KERNELS_BEGIN = 6  # a kernel capture began with step b: kernel slots for its steps follow
    KERNELS_END = 7  # the kernel capture that began at step c wrote its last kernel slot (its last step b)


#: A STEP_BEGIN slot's ``flags`` bit 0 (profiler's ring): the step is timed on the device, a DEVICE_TIME slot of
#: target STEP follows for it (after the step's other DEVICE_TIME slots).
STEP_TIMED = 1

#: ring name → the kinds it holds; blobs hold the kinds >= 20
RINGS: dict[str, tuple[Kind, ...]] = {
    "step": (Kind.STEP_BEGIN, Kind.STEP_END, Kind.PHASE, Kind.SCALAR),
    "module": (Kind.MODULE_ENTER, Kind.MODULE_EXIT),
    "op": (Kind.OP,),
    "memory": (Kind.MEMORY, Kind.MEMORY_PEAK),
    "collective": (Kind.COLLECTIVE,),
    "device": (Kind.DEVICE_TIME,),
    "monitor": (Kind.MONITOR_VALUE,),
    "monitor_anomaly": (Kind.MONITOR_ANOMALY,),
}

#: slots per ring, and blob slots ("blob": prints, faults, settings changes, graphs, markers)
DEFAULT_CAPACITY = {"step": 4096, "module": 65536, "op": 65536, "memory": 4096, "collective": 8192, "blob": 1024}

#: rings a file has only where its writer asks for them (the profiler's ``device`` ring; the training-health monitor's
#: last steps and anomalies, laid out when the env config's ``monitor`` section is on): not in DEFAULT_CAPACITY, so
#: the recorder's rings and its ``rdr.capacity`` keys stay as they were
OPTIONAL_RINGS = frozenset({"device", "monitor", "monitor_anomaly"})

#: rings whose slots are not events: read into ``RingContents.side``, never into ``events.jsonl``
SIDE_RINGS = frozenset({"monitor", "monitor_anomaly"})

#: The largest ring file obs creates.  The whole file is reserved on disk (posix_fallocate) and mapped
#: with MAP_POPULATE, so every byte costs page cache (and resident memory) per rank for the whole run,
#: and a dump reads it all.  1 GiB is ~70x the default ring (~14 MiB) and holds ~19 million event
#: slots: far more history than a post-mortem needs, while 8 ranks on one node still stay under 8 GiB.
MAX_RING_BYTES = 1 << 30


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    capacity: int


@dataclass(frozen=True)
class Header:
    """The first page: who wrote the file, the clocks to turn ``t_ns`` into wall time, the regions."""

    pid: int
    rank: int
    world_size: int
    wall_ns: int
    mono_ns: int
    strings: Region
    strings_used: int
    blobs: Region
    rings: tuple[Region, ...]
    meta: dict[str, Any]

    def wall(self, t_ns: int) -> int:
        """Wall-clock ns of a monotonic ``t_ns`` recorded by the writer."""
        return self.wall_ns + (t_ns - self.mono_ns)

    def encode(self) -> bytes:
        head = HEADER.pack(MAGIC, VERSION, self.pid, self.rank, self.world_size, self.wall_ns, self.mono_ns,
                           self.strings.offset, self.strings.capacity, self.strings_used, self.blobs.offset,
                           self.blobs.capacity, len(self.rings))
        regions = b"".join(REGION.pack(r.name.encode(), r.offset, r.capacity) for r in self.rings)
        meta = json.dumps(self.meta, separators=(",", ":")).encode()
        out = head + regions + struct.pack("<I", len(meta)) + meta
        if len(out) > HEADER_SIZE:
            raise ValueError(f"ring header metadata too large ({len(out)} bytes > {HEADER_SIZE})")
        return out.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def decode(cls, data: bytes | memoryview | mmap.mmap, *, path: str = "<ring>", size: int | None = None) -> Header:
        """The header of a ring file of ``size`` bytes (default ``len(data)``), every field checked.

        Raises :class:`NotOurFileError` when ``data`` is not a ring file (magic, version) and
        :class:`DamagedFileError` (with the byte offset) when it is one whose header is damaged.
        """
        from obs._core.errors import DamagedFileError, NotOurFileError  # lazily: obs's settings import this module

        size = len(data) if size is None else size
        if 0 < len(data) < len(MAGIC) and MAGIC.startswith(bytes(data)):
            raise DamagedFileError(f"{path}: ring file is truncated at byte {len(data)}", path=path, offset=len(data))
        if bytes(data[:8]) != MAGIC:
            raise NotOurFileError(f"{path}: not an obs ring file (expected magic {MAGIC!r} at byte 0, got "
                                  f"{bytes(data[:8])!r})", path=path)
        if len(data) < HEADER_SIZE:
            raise DamagedFileError(f"{path}: ring file is truncated at byte {len(data)}: its header alone takes "
                                   f"{HEADER_SIZE} bytes", path=path, offset=len(data))
        (_, version, pid, rank, world, wall_ns, mono_ns, s_off, s_cap, s_used, b_off, b_cap,
         n_rings) = HEADER.unpack_from(data, 0)
        if version != VERSION:
            raise NotOurFileError(f"{path}: ring file version {version} is not supported (this obs reads version "
                                  f"{VERSION})", path=path)

        def damaged(offset: int, what: str) -> DamagedFileError:
            return DamagedFileError(f"{path}: damaged ring header at byte {offset}: {what}", path=path, offset=offset)

        if wall_ns < 0 or mono_ns < 0:
            raise damaged(24, f"clock values must not be negative (wall {wall_ns}, monotonic {mono_ns})")
        max_rings = (HEADER_SIZE - HEADER.size - 4) // REGION.size
        if n_rings > max_rings:
            raise damaged(HEADER.size - 4, f"{n_rings} rings do not fit in the header (at most {max_rings})")
        at = HEADER.size
        rings: list[Region] = []
        for _ in range(n_rings):
            raw, offset, capacity = REGION.unpack_from(data, at)
            try:
                name = raw.rstrip(b"\0").decode()
            except UnicodeDecodeError:
                raise damaged(at, f"ring name {raw!r} is not UTF-8") from None
            if name in {r.name for r in rings} or not name.isidentifier():
                raise damaged(at, f"ring name {name!r} is not a valid, unique ring name")
            rings.append(Region(name, offset, capacity))
            at += REGION.size
        (meta_len,) = struct.unpack_from("<I", data, at)
        if at + 4 + meta_len > HEADER_SIZE:
            raise damaged(at, f"metadata length {meta_len} runs past the {HEADER_SIZE}-byte header")
        try:
            meta = json.loads(bytes(data[at + 4:at + 4 + meta_len]) or b"{}")
        except (ValueError, RecursionError) as exc:
            raise damaged(at + 4, f"metadata is not JSON ({str(exc)[:80]})") from None
        if not isinstance(meta, dict):
            raise damaged(at + 4, f"metadata is a JSON {type(meta).__name__}, not an object")
        strings, blobs = Region("strings", s_off, s_cap), Region("blobs", b_off, b_cap)
        if s_used > s_cap:
            raise damaged(STRINGS_USED_AT, f"strings used ({s_used}) exceed the table's capacity ({s_cap})")
        # Every region lies inside the file and none overlaps another: what a reader copies out is
        # then bounded by the file's size, whatever the lengths say.
        spans = sorted([(s_off, s_cap, "strings"), (b_off, b_cap * BLOB_SIZE, "blobs")]
                       + [(r.offset, r.capacity * SLOT.size, r.name) for r in rings])
        end = HEADER_SIZE
        for offset, length, name in spans:
            if offset < end:
                raise damaged(offset, f"region {name!r} starts at byte {offset}, inside the header or the region "
                                      f"before it (which ends at byte {end})")
            end = offset + length
            if end > size:
                raise DamagedFileError(f"{path}: ring file is truncated at byte {size}: region {name!r} ends at "
                                       f"byte {end}", path=path, offset=size)
        return cls(pid, rank, world, wall_ns, mono_ns, strings, s_used, blobs, tuple(rings), meta)


def check_capacity(capacity: Mapping[str, Any]) -> int:
    """The size in bytes of a ring file with ``capacity`` (missing keys take :data:`DEFAULT_CAPACITY`).

    Raises :class:`ObsConfigError` naming the key when a key is unknown, a count is not a whole
    number >= 1, or the file would exceed :data:`MAX_RING_BYTES` (the message gives the size it would
    take, the key that asks for most of it, and the limit).
    """
    from obs._core.errors import ObsConfigError  # lazily: obs's settings import this module

    full = {**DEFAULT_CAPACITY}
    for key, value in capacity.items():
        option = f"capacity.{key}"
        if key not in DEFAULT_CAPACITY and key not in OPTIONAL_RINGS:
            raise ObsConfigError(f"rdr {option}: unknown ring (expected one of {', '.join(DEFAULT_CAPACITY)})",
                                 option=option, value=value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ObsConfigError(f"rdr {option} must be a whole number of slots >= 1 (got {value!r})",
                                 option=option, value=value)
        full[key] = value
    parts = {key: full[key] * (BLOB_SIZE if key == "blob" else SLOT.size) for key in full}
    total = plan(full)[3]
    if total > MAX_RING_BYTES:
        key = max(parts, key=parts.__getitem__)
        raise ObsConfigError(
            f"rdr capacity.{key}={full[key]} asks for a ring file of {_size(total)} ({full[key]} slots x "
            f"{parts[key] // full[key]} bytes = {_size(parts[key])}); the limit is {_size(MAX_RING_BYTES)} per "
            f"rank (the whole file is reserved on disk and kept in memory); lower capacity.{key}",
            option=f"capacity.{key}", value=full[key])
    return total


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def plan(capacity: dict[str, int]) -> tuple[Region, Region, tuple[Region, ...], int]:
    """Offsets of the string table, the blob ring and each event ring; and the file size.  An optional ring is
    laid out only where ``capacity`` names it."""
    strings = Region("strings", HEADER_SIZE, STRINGS_SIZE)
    at = strings.offset + strings.capacity
    blobs = Region("blobs", at, capacity["blob"])
    at += capacity["blob"] * BLOB_SIZE
    rings = []
    for name in RINGS:
        if name in OPTIONAL_RINGS and name not in capacity:
            continue
        rings.append(Region(name, at, capacity[name]))
        at += capacity[name] * SLOT.size
    return strings, blobs, tuple(rings), at


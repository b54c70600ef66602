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
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["BLOB", "BLOB_SIZE", "DEFAULT_CAPACITY", "HEADER", "HEADER_SIZE", "MAGIC", "RINGS", "SLOT",
           "STRINGS_USED_AT", "VERSION", "Header", "Kind", "Region", "plan"]

MAGIC = b"OBSRING\x01"
VERSION = 1
HEADER_SIZE = 4096
STRINGS_SIZE = 4 << 20
BLOB_SIZE = 2048

#: seq, idx, t_ns, kind, flags, a, b, c, d
SLOT = struct.Struct("<QQqHHiqqq")
#: seq, t_ns, kind, length, idx (1-based count of blobs written)
BLOB = struct.Struct("<QqHHI")
#: magic, version, pid, rank, world_size, wall_ns, mono_ns, strings (off, cap, used), blobs (off, cap), n_rings
HEADER = struct.Struct("<8sIIIIqqQQQQQI")
REGION = struct.Struct("<16sQQ")  # ring name, offset, capacity
STRINGS_USED_AT = struct.calcsize("<8sIIIIqqQQ")  # byte offset of strings_used in the header


class Kind(enum.IntEnum):
    """What a slot or blob records; the meaning of a, b, c, d per kind is in ``recorder.ring``."""

    STEP_BEGIN = 1
    STEP_END = 2
    MODULE_ENTER = 3
    MODULE_EXIT = 4
    OP = 5
    MEMORY = 6
    COLLECTIVE = 7
    PRINT = 20
    FAULT = 21
    SETTINGS = 22
    GRAPH = 23
    MARKER = 24


#: ring name → the kinds it holds; blobs hold the kinds >= 20
RINGS: dict[str, tuple[Kind, ...]] = {
    "step": (Kind.STEP_BEGIN, Kind.STEP_END),
    "module": (Kind.MODULE_ENTER, Kind.MODULE_EXIT),
    "op": (Kind.OP,),
    "memory": (Kind.MEMORY,),
    "collective": (Kind.COLLECTIVE,),
}

#: slots per ring, and blob slots ("blob": prints, faults, settings changes, graphs, markers)
DEFAULT_CAPACITY = {"step": 4096, "module": 65536, "op": 65536, "memory": 4096, "collective": 8192, "blob": 1024}


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
    def decode(cls, data: bytes | memoryview) -> Header:
        if len(data) < HEADER_SIZE or bytes(data[:8]) != MAGIC:
            raise ValueError(f"not an obs ring file (expected magic {MAGIC!r}, got {bytes(data[:8])!r})")
        (_, version, pid, rank, world, wall_ns, mono_ns, s_off, s_cap, s_used, b_off, b_cap,
         n_rings) = HEADER.unpack_from(data, 0)
        if version != VERSION:
            raise ValueError(f"ring file version {version} is not supported (this obs reads version {VERSION})")
        at = HEADER.size
        rings = []
        for _ in range(n_rings):
            name, offset, capacity = REGION.unpack_from(data, at)
            rings.append(Region(name.rstrip(b"\0").decode(), offset, capacity))
            at += REGION.size
        (meta_len,) = struct.unpack_from("<I", data, at)
        meta = json.loads(bytes(data[at + 4:at + 4 + meta_len]) or b"{}")
        return cls(pid, rank, world, wall_ns, mono_ns, Region("strings", s_off, s_cap), s_used,
                   Region("blobs", b_off, b_cap), tuple(rings), meta)


def plan(capacity: dict[str, int]) -> tuple[Region, Region, tuple[Region, ...], int]:
    """Offsets of the string table, the blob ring and each event ring; and the file size."""
    strings = Region("strings", HEADER_SIZE, STRINGS_SIZE)
    at = strings.offset + strings.capacity
    blobs = Region("blobs", at, capacity["blob"])
    at += capacity["blob"] * BLOB_SIZE
    rings = []
    for name in RINGS:
        rings.append(Region(name, at, capacity[name]))
        at += capacity[name] * SLOT.size
    return strings, blobs, tuple(rings), at


"""Read a ring file (live map or a dead process's file) into events, in the order they happened.

Pure: bytes in, :class:`RingContents` out.  Decoding is vectorised with numpy, and JSON lines are
formatted per kind, once per contents.  A dump of full default rings aims at 250 ms; bench_rdr measured
243 and 286 ms, most of it this Python formatting.

A damaged file ends in :class:`DamagedFileError` (file and byte offset), a file that is not a ring
in :class:`NotOurFileError`; what is read is bounded by the file's size (the header's regions are
checked to lie inside the file, without overlapping, before anything is copied out).

Slots do not store the step of an op or a collective: :meth:`RingContents.steps` derives it from
the step ring (the step of the latest step event before the slot, by ``seq``).
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from obs._core import safe_files
from obs._core.errors import NotOurFileError
from recorder.collective_desc import COLLECTIVE_STATES
from recorder.layout import BLOB, BLOB_SIZE, HEADER_SIZE, PHASE_NAMES, SIDE_RINGS, SLOT, Header, Kind

__all__ = ["SLOT_DTYPE", "RingContents", "read_blobs", "read_header_file", "read_ring", "read_ring_file",
           "read_strings", "region_slots", "region_tail"]

SLOT_DTYPE = np.dtype([("seq", "<u8"), ("idx", "<u8"), ("t", "<i8"), ("kind", "<u2"), ("flags", "<u2"),
                       ("a", "<i4"), ("b", "<i8"), ("c", "<i8"), ("d", "<i8")])
assert SLOT_DTYPE.itemsize == SLOT.size
_U32 = struct.Struct("<I")
_STATES = COLLECTIVE_STATES
_OPEN_SHOWN = 64  # innermost open modules reported (deeper nests are interleaved threads, not a real stack)


@dataclass
class RingContents:
    """Everything a ring holds: header, interned strings, slots (sorted by seq) and blobs."""

    header: Header
    strings: list[str]
    slots: np.ndarray  # SLOT_DTYPE, written slots of every ring, sorted by seq
    blobs: list[tuple[int, int, str, dict[str, Any]]]  # (seq, t_ns, kind name, payload)
    dropped: dict[str, int] = field(default_factory=dict)
    #: slots of the rings that are not events (``layout.SIDE_RINGS``: the monitor's), by ring, in idx order
    side: dict[str, np.ndarray] = field(default_factory=dict)
    _lines: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def string(self, sid: int) -> str:
        return self.strings[sid] if 0 <= sid < len(self.strings) else "?"

    def summary(self) -> dict[str, Any]:
        """Step reached, the last module entered in that step (None where it called none), last op (with scope),
        modules still open at the end."""
        out: dict[str, Any] = {"step": 0, "last_module": None, "last_op": None, "open_modules": []}
        kinds = self.slots["kind"]
        steps = self.slots[(kinds == Kind.STEP_BEGIN) | (kinds == Kind.STEP_END)]
        if len(steps):
            out["step"] = int(steps["b"][-1])
        modules = self.slots[(kinds == Kind.MODULE_ENTER) | (kinds == Kind.MODULE_EXIT)]
        if len(modules):
            enter = modules["kind"] == Kind.MODULE_ENTER
            # an earlier step's module is not the last one of a step that raised before calling any
            begins = steps["seq"][steps["kind"] == Kind.STEP_BEGIN]
            entered = enter & (modules["seq"] > begins[-1]) if len(begins) else enter
            out["last_module"] = self.string(int(modules["a"][entered][-1])) if entered.any() else None
            # An enter is still open if the nesting depth never drops below its level afterwards.
            depth = np.cumsum(np.where(enter, 1, -1))
            floor = np.minimum.accumulate(depth[::-1])[::-1]
            still_open = enter & (floor >= depth)
            out["open_modules"] = [self.string(int(a)) for a in modules["a"][still_open][-_OPEN_SHOWN:]]
        ops = self.slots[kinds == Kind.OP]
        if len(ops):
            last = ops[-1]
            out["last_op"] = {"name": self.string(int(last["a"])), "scope": self.string(int(last["b"])),
                              "inputs": self.string(int(last["d"])), "error": bool(last["flags"] & 1)}
        return out

    def steps(self, seqs: np.ndarray) -> np.ndarray:
        """The step each of ``seqs`` happened in: the step of the latest step event with a smaller seq
        (between STEP_END n and STEP_BEGIN n+1 that is n).  Before the first step event left in the ring,
        one less than its step if it is a STEP_BEGIN, its step if it is a STEP_END; 0 with no step event."""
        marks = self.slots[np.isin(self.slots["kind"], (Kind.STEP_BEGIN, Kind.STEP_END))]
        if not len(marks):
            return np.zeros(len(seqs), dtype=np.int64)
        at = np.searchsorted(marks["seq"], seqs, side="left") - 1
        first = marks[0]
        before = int(first["b"]) - 1 if first["kind"] == Kind.STEP_BEGIN and int(first["b"]) > -(1 << 63) \
            else int(first["b"])
        return np.where(at >= 0, marks["b"][np.maximum(at, 0)], np.int64(before))

    def event_lines(self, kinds: tuple[Kind, ...] | None = None) -> list[str]:
        """One JSON object per event (optionally only ``kinds``), slots and blobs merged in seq order.

        Every event has a ``step``: module, step and memory slots store it, the others get
        :meth:`steps`' (blobs keep a ``step`` of their own payload)."""
        lines: list[str]
        if kinds is None:
            slots, lines = self.slots, self._slot_lines().tolist()
        else:
            chosen = np.isin(self.slots["kind"], kinds)
            slots, lines = self.slots[chosen], self._slot_lines()[chosen].tolist()
        blobs = [b for b in self.blobs if kinds is None or _BLOB_KINDS.get(b[2]) in kinds]
        if blobs:
            blob_steps = self.steps(np.array([b[0] for b in blobs], dtype=np.uint64)).tolist()
            lines = _merge(lines, slots["seq"].tolist(),
                           [(b[0], _blob_line(b, self.header, st)) for b, st in zip(blobs, blob_steps)])
        return lines

    def _slot_lines(self) -> np.ndarray:
        """Every slot's JSON line, in slot order (an object array), formatted once: a bundle takes several
        selections of the same lines."""
        if self._lines is not None:
            return self._lines
        slots = self.slots
        esc = [json.dumps(x) for x in self.strings] + ["null"]  # index -1 (unknown) → null
        out = np.empty(len(slots), dtype=object)
        wall = slots["t"] + np.int64(self.header.wall_ns - self.header.mono_ns)
        derived = self.steps(slots["seq"])
        for kind in np.unique(slots["kind"]).tolist():
            where = np.nonzero(slots["kind"] == kind)[0]
            part = slots[where]
            ids = {f: np.where((part[f] >= 0) & (part[f] < len(esc) - 1), part[f], -1) for f in ("a", "b", "d")}
            cols = {"seq": part["seq"].tolist(), "t": wall[where].tolist(), "flags": part["flags"].tolist(),
                    "a": part["a"].tolist(), "wall": [self.header.wall_ns - self.header.mono_ns],
                    "b": part["b"].tolist(), "c": part["c"].tolist(), "d": part["d"].tolist(),
                    "a_name": [esc[i] for i in ids["a"].tolist()], "step": derived[where].tolist()}
            if kind == Kind.OP:
                cols["b_name"] = [esc[i] for i in ids["b"].tolist()]
                cols["d_name"] = [esc[i] for i in ids["d"].tolist()]
            out[where] = _format(kind, cols)
        self._lines = out
        return out

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.event_lines()]


def _format(kind: int, c: dict[str, list[Any]]) -> list[str]:
    """The JSON lines of one kind's slots, from column lists (one comprehension per kind: fast)."""
    seq, t, flags, b, dur, d, a, step = c["seq"], c["t"], c["flags"], c["b"], c["c"], c["d"], c["a_name"], c["step"]
    if kind in (Kind.MODULE_ENTER, Kind.MODULE_EXIT):
        name = _NAMES[kind]
        return [f'{{"seq":{s},"t":{w},"kind":"{name}","scope":{n},"step":{st}{_ERR[f & 1]}}}'
                for s, w, f, n, st in zip(seq, t, flags, a, b)]
    if kind == Kind.OP:
        return [f'{{"seq":{s},"t":{w},"kind":"op","name":{n},"scope":{sc},"step":{st},"duration_ns":{du},'
                f'"inputs":{i}{_op_flags(f)}}}'
                for s, w, f, n, sc, st, du, i in zip(seq, t, flags, a, c["b_name"], step, dur, c["d_name"])]
    if kind == Kind.STEP_BEGIN:
        return [f'{{"seq":{s},"t":{w},"kind":"step_begin","step":{st}}}' for s, w, st in zip(seq, t, b)]
    if kind == Kind.STEP_END:
        return [f'{{"seq":{s},"t":{w},"kind":"step_end","step":{st},"duration_ns":{du}}}'
                for s, w, st, du in zip(seq, t, b, dur)]
    if kind == Kind.PHASE:  # begin and end are monotonic ns, like t: turned into wall time as t is
        shift = c["wall"][0]
        return [f'{{"seq":{s},"t":{w},"kind":"phase","phase":"{_phase(p)}","step":{st},"begin_t":{b0 + shift},'
                f'"end_t":{b1 + shift}}}' for s, w, p, st, b0, b1 in zip(seq, t, c["a"], b, dur, d)]
    if kind == Kind.MEMORY:
        return [f'{{"seq":{s},"t":{w},"kind":"memory","device":{n},"step":{st},"used_bytes":{u},"other_bytes":{o}}}'
                for s, w, n, st, u, o in zip(seq, t, a, b, dur, d)]
    if kind == Kind.MEMORY_PEAK:
        return [f'{{"seq":{s},"t":{w},"kind":"memory_peak","device":{n},"step":{st},"peak_allocated_bytes":{u},'
                f'"peak_reserved_bytes":{o}}}' for s, w, n, st, u, o in zip(seq, t, a, b, dur, d)]
    if kind == Kind.COLLECTIVE:
        return [f'{{"seq":{s},"t":{w},"kind":"collective","desc":{n},"group_seq":{g},"step":{st},"duration_ns":{du},'
                f'"state":"{_STATES[x] if 0 <= x < len(_STATES) else x}"{_ERR[f & 1]}}}'
                for s, w, f, n, g, st, du, x in zip(seq, t, flags, a, b, step, dur, d)]
    return [f'{{"seq":{s},"t":{w},"kind":"{_NAMES.get(kind, kind)}","step":{st}}}' for s, w, st in zip(seq, t, step)]


_ERR = ("", ',"error":true')


def _phase(code: int) -> str:
    return PHASE_NAMES[code] if 0 <= code < len(PHASE_NAMES) else f"phase_{code}"


@functools.lru_cache(maxsize=1024)
def _op_flags(flags: int) -> str:
    """An op slot's flags as JSON members: bit 0 error, bit 1 nested in another op, bits 4-15 the native
    observer's thread number (0: recorded by the Python dispatch mode, which has none)."""
    thread = flags >> 4
    return _ERR[flags & 1] + (',"nested":true' if flags & 2 else "") + (f',"thread":{thread}' if thread else "")


def _merge(lines: list[str], seqs: list[int], extra: list[tuple[int, str]]) -> list[str]:
    """Insert ``extra`` (seq, line) pairs, sorted by seq, into ``lines`` (sorted by ``seqs``)."""
    out: list[str] = []
    i = 0
    for seq, line in extra:
        j = bisect.bisect_left(seqs, seq, lo=i)
        out.extend(lines[i:j])
        out.append(line)
        i = j
    out.extend(lines[i:])
    return out


_NAMES = {k.value: k.name.lower() for k in Kind}
_BLOB_KINDS = {k.name.lower(): k for k in Kind}


def _blob_line(blob: tuple[int, int, str, dict[str, Any]], header: Header, step: int) -> str:
    seq, t, kind, payload = blob
    return json.dumps({"step": step, **payload, "seq": seq, "t": header.wall(t), "kind": kind},
                      separators=(",", ":"), default=str)


def read_ring(data: Any, *, path: str = "<ring>", rings: Collection[str] | None = None,
              tails: Mapping[str, int] | None = None, blobs: bool = True) -> RingContents:
    """Decode a ring from a buffer (an mmap of a live ring, or a file's bytes); ``path`` names it in errors.

    A live view reads less: only the slot ``rings`` named (default all), only the newest ``tails[name]`` slots of
    a ring (the rest of it is not copied), and no blobs when ``blobs`` is False."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    header = Header.decode(view, path=path)
    strings, _ = read_strings(view, header)
    parts, dropped, side = [], {}, {}
    for region in header.rings:  # Header.decode checked that every region lies inside the file
        if rings is not None and region.name not in rings:
            continue
        keep = (tails or {}).get(region.name)
        slots = region_tail(view, region, keep) if keep is not None else region_slots(view, region)
        slots = slots[slots["seq"] > 0]
        top = int(slots["idx"].max()) if len(slots) else 0
        dropped[region.name] = max(0, top - region.capacity) if keep is None else 0
        if region.name in SIDE_RINGS:
            side[region.name] = slots[np.argsort(slots["idx"], kind="stable")]
            continue
        parts.append(slots)
    merged = np.concatenate(parts) if parts else np.empty(0, SLOT_DTYPE)
    merged = merged[np.argsort(merged["seq"], kind="stable")]
    found: list[tuple[int, int, str, dict[str, Any]]] = []
    if blobs:
        found, dropped["blob"] = _blobs(view, header)
    return RingContents(header, strings, merged, found, dropped, side)


def _read_all(fd: int, path: str) -> bytes:
    with open(fd, "rb", closefd=False) as fh:
        data = fh.read()
    if not data:
        raise NotOurFileError(f"{path}: empty file, not an obs ring file", path=path)
    return data


def read_ring_file(path: str, *, fd: int | None = None) -> RingContents:
    """Read the ring file ``path`` (opened with ``safe_files.open_private``: no symlink, a regular file of
    this user), or the already open ``fd`` (left open)."""
    own = fd is None
    if fd is None:
        fd = safe_files.open_private(path)
    try:
        return read_ring(_read_all(fd, path), path=path)
    finally:
        if own:
            os.close(fd)


def read_header_file(path: str, *, fd: int | None = None) -> Header:
    """Only the header of ring file ``path`` (checked against the file's size), as cheaply as possible."""
    own = fd is None
    if fd is None:
        fd = safe_files.open_private(path)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, HEADER_SIZE, 0)
        if not data:
            raise NotOurFileError(f"{path}: empty file, not an obs ring file", path=path)
        return Header.decode(data, path=path, size=size)
    finally:
        if own:
            os.close(fd)


def read_strings(view: Any, header: Header, *, start: int = 0, used: int | None = None) -> tuple[list[str], int]:
    """The interned strings from byte ``start`` of the string table up to ``used`` bytes (default: the header's
    count; a follower reads the live count), and where the next read starts (after the last whole string)."""
    base = header.strings.offset
    end = min(header.strings_used if used is None else used, header.strings.capacity)
    out, at = [], start
    while at + 4 <= end:
        (length,) = _U32.unpack_from(view, base + at)
        if at + 4 + length > end:
            break
        out.append(bytes(view[base + at + 4:base + at + 4 + length]).decode("utf-8", "replace"))
        at += 4 + length
    return out, at


def read_blobs(view: Any, header: Header) -> list[tuple[int, int, int, int, Any]]:
    """Every written blob as ``(idx, seq, t_ns, kind, payload)``, by idx; ``payload`` is None where its JSON is
    torn (a process killed mid-write: a blob's seq is written last, so a blob being written is skipped)."""
    out = []
    for i in range(header.blobs.capacity):
        at = header.blobs.offset + i * BLOB_SIZE
        seq, t, kind, length, idx = BLOB.unpack_from(view, at)
        if seq == 0 or length > BLOB_SIZE - BLOB.size:
            continue
        try:
            payload = json.loads(bytes(view[at + BLOB.size:at + BLOB.size + length]))
        except (ValueError, RecursionError):
            payload = None
        out.append((idx, seq, t, kind, payload))
    out.sort(key=lambda b: b[0])
    return out


def region_slots(view: Any, region: Any) -> np.ndarray:
    """A copy of one slot ring's slots (one snapshot of a live map)."""
    return np.frombuffer(view, SLOT_DTYPE, region.capacity, region.offset).copy()


def region_tail(view: Any, region: Any, count: int) -> np.ndarray:
    """A copy of the newest ``count`` slots of one slot ring (the ones with the highest ``idx``), oldest first."""
    slots = np.frombuffer(view, SLOT_DTYPE, region.capacity, region.offset)
    newest = int(np.argmax(slots["idx"]))
    where = (np.arange(newest - min(count, region.capacity) + 1, newest + 1)) % region.capacity
    tail: np.ndarray = slots[where].copy()
    return tail


def _blobs(view: memoryview, header: Header) -> tuple[list[tuple[int, int, str, dict[str, Any]]], int]:
    blobs = read_blobs(view, header)
    out = [(seq, t, _NAMES.get(kind, str(kind)),
            {"unreadable": True} if payload is None else payload if isinstance(payload, dict) else {"value": payload})
           for _, seq, t, kind, payload in blobs]
    out.sort(key=lambda b: b[0])
    top = max((b[0] for b in blobs), default=0)
    return out, max(0, top - header.blobs.capacity)



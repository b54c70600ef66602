"""Read a ring file (live map or a dead process's file) into events, in the order they happened.

Pure: bytes in, :class:`RingContents` out.  Decoding is vectorised with numpy so a dump of full
default rings stays well under the 250 ms budget; JSON lines are formatted per kind.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recorder.layout import BLOB, BLOB_SIZE, SLOT, Header, Kind

__all__ = ["RingContents", "read_ring", "read_ring_file"]

SLOT_DTYPE = np.dtype([("seq", "<u8"), ("idx", "<u8"), ("t", "<i8"), ("kind", "<u2"), ("flags", "<u2"),
                       ("a", "<i4"), ("b", "<i8"), ("c", "<i8"), ("d", "<i8")])
assert SLOT_DTYPE.itemsize == SLOT.size
_STATES = ("scheduled", "started", "completed")


@dataclass
class RingContents:
    """Everything a ring holds: header, interned strings, slots (sorted by seq) and blobs."""

    header: Header
    strings: list[str]
    slots: np.ndarray  # SLOT_DTYPE, written slots of every ring, sorted by seq
    blobs: list[tuple[int, int, str, dict[str, Any]]]  # (seq, t_ns, kind name, payload)
    dropped: dict[str, int] = field(default_factory=dict)

    def string(self, sid: int) -> str:
        return self.strings[sid] if 0 <= sid < len(self.strings) else "?"

    def summary(self) -> dict[str, Any]:
        """Step reached, last module entered, last op (with scope), modules still open at the end."""
        s = self.strings
        out: dict[str, Any] = {"step": 0, "last_module": None, "last_op": None, "open_modules": []}
        kinds = self.slots["kind"]
        steps = self.slots[(kinds == Kind.STEP_BEGIN) | (kinds == Kind.STEP_END)]
        if len(steps):
            out["step"] = int(steps["b"][-1])
        modules = self.slots[(kinds == Kind.MODULE_ENTER) | (kinds == Kind.MODULE_EXIT)]
        stack: list[str] = []
        for kind, a in zip(modules["kind"].tolist(), modules["a"].tolist()):
            scope = s[a] if 0 <= a < len(s) else "?"
            if kind == Kind.MODULE_ENTER:
                stack.append(scope)
            elif scope in stack:
                del stack[len(stack) - 1 - stack[::-1].index(scope):]
        entered = modules[modules["kind"] == Kind.MODULE_ENTER]
        if len(entered):
            out["last_module"] = self.string(int(entered["a"][-1]))
        out["open_modules"] = stack
        ops = self.slots[kinds == Kind.OP]
        if len(ops):
            last = ops[-1]
            out["last_op"] = {"name": self.string(int(last["a"])), "scope": self.string(int(last["b"])),
                              "inputs": self.string(int(last["d"])), "error": bool(last["flags"] & 1)}
        return out

    def event_lines(self) -> Iterator[str]:
        """One JSON object per event, slots and blobs merged in seq order."""
        esc = [json.dumps(x) for x in self.strings]
        n = len(esc)
        header = self.header
        blobs = iter(self.blobs)
        blob = next(blobs, None)
        for seq, _, t, kind, flags, a, b, c, d in self.slots.tolist():
            while blob is not None and blob[0] < seq:
                yield _blob_line(blob, header)
                blob = next(blobs, None)
            wall = header.wall(t)
            if kind == Kind.MODULE_ENTER or kind == Kind.MODULE_EXIT:
                err = ',"error":true' if flags & 1 else ""
                yield (f'{{"seq":{seq},"t":{wall},"kind":"{_NAMES[kind]}","scope":{esc[a] if 0 <= a < n else "null"},'
                       f'"step":{b}{err}}}')
            elif kind == Kind.OP:
                err = ',"error":true' if flags & 1 else ""
                yield (f'{{"seq":{seq},"t":{wall},"kind":"op","name":{esc[a] if 0 <= a < n else "null"},'
                       f'"scope":{esc[b] if 0 <= b < n else "null"},"duration_ns":{c},'
                       f'"inputs":{esc[d] if 0 <= d < n else "null"}{err}}}')
            elif kind == Kind.STEP_BEGIN:
                yield f'{{"seq":{seq},"t":{wall},"kind":"step_begin","step":{b}}}'
            elif kind == Kind.STEP_END:
                yield f'{{"seq":{seq},"t":{wall},"kind":"step_end","step":{b},"duration_ns":{c}}}'
            elif kind == Kind.MEMORY:
                yield (f'{{"seq":{seq},"t":{wall},"kind":"memory","device":{esc[a] if 0 <= a < n else "null"},'
                       f'"step":{b},"used_bytes":{c},"other_bytes":{d}}}')
            elif kind == Kind.COLLECTIVE:
                state = _STATES[d] if 0 <= d < 3 else str(d)
                yield (f'{{"seq":{seq},"t":{wall},"kind":"collective","desc":{esc[a] if 0 <= a < n else "null"},'
                       f'"group_seq":{b},"duration_ns":{c},"state":"{state}"}}')
        while blob is not None:
            yield _blob_line(blob, header)
            blob = next(blobs, None)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.event_lines()]


_NAMES = {k.value: k.name.lower() for k in Kind}


def _blob_line(blob: tuple[int, int, str, dict[str, Any]], header: Header) -> str:
    seq, t, kind, payload = blob
    return json.dumps({**payload, "seq": seq, "t": header.wall(t), "kind": kind}, separators=(",", ":"), default=str)


def read_ring(data: Any) -> RingContents:
    """Decode a ring from a buffer (an mmap of a live ring, or a file's bytes)."""
    view = memoryview(data)
    header = Header.decode(view)
    strings = _strings(view, header)
    parts, dropped = [], {}
    for region in header.rings:
        end = region.offset + region.capacity * SLOT.size
        if end > len(view):
            raise ValueError(f"ring file is truncated: ring {region.name!r} ends at byte {end}, file has {len(view)}")
        slots = np.frombuffer(view, SLOT_DTYPE, region.capacity, region.offset)
        slots = slots[slots["seq"] > 0].copy()
        dropped[region.name] = max(0, int(slots["idx"].max()) - region.capacity) if len(slots) else 0
        parts.append(slots)
    merged = np.concatenate(parts) if parts else np.empty(0, SLOT_DTYPE)
    merged = merged[np.argsort(merged["seq"], kind="stable")]
    blobs, blob_dropped = _blobs(view, header)
    dropped["blob"] = blob_dropped
    return RingContents(header, strings, merged, blobs, dropped)


def read_ring_file(path: str) -> RingContents:
    with open(path, "rb") as fh:
        return read_ring(fh.read())


def _strings(view: memoryview, header: Header) -> list[str]:
    out, at = [], header.strings.offset
    end = at + min(header.strings_used, header.strings.capacity)
    while at + 4 <= end:
        (length,) = struct.unpack_from("<I", view, at)
        if at + 4 + length > end:
            break
        out.append(bytes(view[at + 4:at + 4 + length]).decode("utf-8", "replace"))
        at += 4 + length
    return out


def _blobs(view: memoryview, header: Header) -> tuple[list[tuple[int, int, str, dict[str, Any]]], int]:
    out, top = [], 0
    for i in range(header.blobs.capacity):
        at = header.blobs.offset + i * BLOB_SIZE
        seq, t, kind, length, idx = BLOB.unpack_from(view, at)
        if seq == 0 or length > BLOB_SIZE - BLOB.size:
            continue
        top = max(top, idx)
        try:
            payload = json.loads(bytes(view[at + BLOB.size:at + BLOB.size + length]))
        except ValueError:
            payload = {"unreadable": True}
        out.append((seq, t, _NAMES.get(kind, str(kind)), payload if isinstance(payload, dict) else {"value": payload}))
    out.sort(key=lambda b: b[0])
    return out, max(0, top - header.blobs.capacity)



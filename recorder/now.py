"""What a rank is doing now, read from its ring: the step, the phase, the innermost open module, the open collective.

Pure: a :class:`~recorder.ring_reader.RingContents` in, a plain dict out (the ``now`` object of a live dump's
manifest, what ``obs rdr snapshot`` shows, and each row of ``obs top``).  Times are wall-clock ns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recorder.collective_desc import COLLECTIVE_STATES, parse_collective_desc
from recorder.layout import PHASE_NAMES, Kind
from recorder.ring_reader import RingContents

__all__ = ["now", "open_collective"]

_OPEN = frozenset({COLLECTIVE_STATES.index("scheduled"), COLLECTIVE_STATES.index("started")})
#: a step's phases are recorded as they end: the one a rank is in is the one after the last that ended
_NEXT_PHASE = {"data": "forward", "forward": "backward", "backward": "after backward", "optimizer": "after optimizer"}


def now(contents: RingContents) -> dict[str, Any]:
    """``step`` (the last step begun or ended), ``phase`` (``name`` and ``since_ns``, or None before any step),
    ``module`` (the innermost module still open, or None) and ``module_since_ns``, ``collective``
    (:func:`open_collective`, or None) and ``last_seq`` (the newest sequence number per collective group)."""
    slots = contents.slots
    kinds = slots["kind"]
    marks = slots[(kinds == Kind.STEP_BEGIN) | (kinds == Kind.STEP_END)]
    module, since = _innermost_module(contents)
    collective, last_seq = _collectives(contents)
    return {"step": int(marks["b"][-1]) if len(marks) else 0, "phase": _phase(contents, marks), "module": module,
            "module_since_ns": since, "collective": collective, "last_seq": last_seq}


def open_collective(contents: RingContents) -> dict[str, Any] | None:
    """The newest collective the ring shows begun (``scheduled`` or ``started``) and not ended (no ``completed`` or
    ``failed`` record of the same group and sequence number after it): ``group``, ``seq``, ``op``, ``state`` and
    ``since_ns`` (wall clock of its first record).  None when every collective on record has ended."""
    return _collectives(contents)[0]


def _phase(contents: RingContents, marks: np.ndarray) -> dict[str, Any] | None:
    """After a step ended, loading data; in a step, the phase after the last one that ended."""
    if not len(marks):
        return None
    last, wall = marks[-1], contents.header.wall
    if last["kind"] == Kind.STEP_END:
        return {"name": "data", "since_ns": wall(int(last["t"]))}
    slots = contents.slots
    phases = slots[(slots["kind"] == Kind.PHASE) & (slots["seq"] > last["seq"])]
    if not len(phases):
        return {"name": "forward", "since_ns": wall(int(last["t"]))}
    code = int(phases["a"][-1])
    name = PHASE_NAMES[code] if 0 <= code < len(PHASE_NAMES) else f"phase_{code}"
    return {"name": _NEXT_PHASE.get(name, name), "since_ns": wall(int(phases["d"][-1]))}


def _innermost_module(contents: RingContents) -> tuple[str | None, int | None]:
    slots = contents.slots
    modules = slots[(slots["kind"] == Kind.MODULE_ENTER) | (slots["kind"] == Kind.MODULE_EXIT)]
    if not len(modules):
        return None, None
    enter = modules["kind"] == Kind.MODULE_ENTER
    # an enter is still open if the nesting depth never drops below its level afterwards
    depth = np.cumsum(np.where(enter, 1, -1))
    floor = np.minimum.accumulate(depth[::-1])[::-1]
    still_open = np.nonzero(enter & (floor >= depth))[0]
    if not len(still_open):
        return None, None
    innermost = modules[still_open[-1]]
    return contents.string(int(innermost["a"])), contents.header.wall(int(innermost["t"]))


def _collectives(contents: RingContents) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """The open collective (see :func:`open_collective`) and the newest sequence number per group."""
    slots = contents.slots[contents.slots["kind"] == Kind.COLLECTIVE]
    descs: dict[int, dict[str, Any]] = {}  # desc string id -> its fields, parsed once per distinct desc
    opened: dict[tuple[str, int], tuple[str, int, int]] = {}  # (group, seq) -> op, first record's t, newest state
    last_seq: dict[str, int] = {}
    for sid, seq, state, t in zip(slots["a"].tolist(), slots["b"].tolist(), slots["d"].tolist(),
                                  slots["t"].tolist()):
        fields = descs.get(sid)
        if fields is None:
            fields = descs[sid] = parse_collective_desc(contents.string(sid))
        key = (str(fields.get("group", "?")), seq)
        last_seq[key[0]] = max(last_seq.get(key[0], 0), seq)
        if state in _OPEN:
            before = opened.get(key)
            opened[key] = (fields["op"], before[1] if before else t, state)
        else:
            opened.pop(key, None)
    if not opened:
        return None, last_seq
    (group, seq), (op, first, state) = max(opened.items(), key=lambda kv: kv[1][1])
    return {"group": group, "seq": seq, "op": op, "state": COLLECTIVE_STATES[state],
            "since_ns": contents.header.wall(first)}, last_seq

"""What a rank is doing now, read from its ring: the step, the phase, the innermost open module, the open collective.

Pure: a :class:`~recorder.ring_reader.RingContents` in, a plain dict out (the ``now`` object of a live dump's
manifest, what ``obs rdr snapshot`` shows, and each row of ``obs top``).  Times are wall-clock ns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recorder.collective_desc import COLLECTIVE_STATES, parse_collective_desc
from recorder.collective_table import runs
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
    return {"step": int(marks["b"][-1]) if len(marks) else 0, "phase": _phase(contents, marks, since),
            "module": module, "module_since_ns": since, "collective": collective, "last_seq": last_seq}


def open_collective(contents: RingContents) -> dict[str, Any] | None:
    """The newest collective the ring shows begun (``scheduled`` or ``started``) and not ended (no ``completed`` or
    ``failed`` record of the same group and sequence number after it): ``group``, ``seq``, ``op``, ``state`` and
    ``since_ns`` (wall clock of its first record).  None when every collective on record has ended."""
    return _collectives(contents)[0]


def _phase(contents: RingContents, marks: np.ndarray, module_since: int | None) -> dict[str, Any] | None:
    """After a step ended, loading data; in a step, the phase after the last one that ended (``module_since``: when
    the innermost open module was entered, or None)."""
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
    since = wall(int(phases["d"][-1]))
    if name == "optimizer" and module_since is not None and module_since >= since:
        return {"name": "forward", "since_ns": since}  # optimizer.step(closure): the optimizer called its closure
    return {"name": _NEXT_PHASE.get(name, name), "since_ns": since}


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
    """The open collective (see :func:`open_collective`) and the newest sequence number per group, with numpy over
    the collective ring's slots (8,192 a rank: a Python loop over them was a third of ``obs top``'s time)."""
    slots = contents.slots[contents.slots["kind"] == Kind.COLLECTIVE]
    if not len(slots):
        return None, {}
    sids, desc = np.unique(slots["a"], return_inverse=True)
    fields = [parse_collective_desc(contents.string(int(sid))) for sid in sids.tolist()]
    names, group_of = np.unique([str(f.get("group", "?")) for f in fields], return_inverse=True)
    group, seq = group_of.reshape(-1)[desc.reshape(-1)], slots["b"]
    order, first, last = runs(group, seq)
    g, q = group[order], seq[order]
    newest = order[last]
    # a key is open since its first record after its last ended one
    ended = np.where(np.isin(slots["d"][order], list(_OPEN)), -1, np.arange(len(order)))
    entry = order[np.minimum(np.maximum(np.maximum.reduceat(ended, first) + 1, first), last)]
    heads = np.flatnonzero(np.append(True, g[first][1:] != g[first][:-1]))  # each group's first key
    tails = np.append(heads[1:], len(first)) - 1
    last_seq = {str(names[g[first[i]]]): int(q[first[j]]) for i, j in zip(heads.tolist(), tails.tolist())}
    still = np.isin(slots["d"][newest], list(_OPEN))  # a key whose newest record is scheduled or started
    if not still.any():
        return None, last_seq
    pick = int(np.flatnonzero(still)[np.argmax(slots["t"][entry][still])])
    key, top, since = int(first[pick]), int(newest[pick]), int(slots["t"][entry[pick]])
    return {"group": str(names[g[key]]), "seq": int(q[key]), "op": fields[int(desc.reshape(-1)[top])]["op"],
            "state": COLLECTIVE_STATES[int(slots["d"][top])], "since_ns": contents.header.wall(since)}, last_seq

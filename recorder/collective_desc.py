"""How a collective record is written into the ring (one interned string per distinct call shape) and read back.

``all_reduce group=1 ranks=0,2 dtype=float32 sizes=[[4,8]]``: the op, then ``key=value`` fields
(``group``, optional ``ranks`` of a subgroup and ``peer`` of a point-to-point op, ``dtype``) and
``sizes`` last, as compact JSON.  Pure: strings in, dicts out.
"""

from __future__ import annotations

import functools
import json
from typing import Any

__all__ = ["COLLECTIVE_STATES", "collective_desc", "parse_collective_desc"]

#: the ring's state codes, in order (``d`` of a COLLECTIVE slot)
COLLECTIVE_STATES = ("scheduled", "started", "completed", "failed")
_FIELDS = ("group", "ranks", "peer", "dtype")


def collective_desc(record: dict[str, Any]) -> str:
    """The ring's description of a COLLECTIVE event's ``record``."""
    parts = [str(record.get("op"))]
    parts += [f"{key}={record[key]}" for key in _FIELDS if record.get(key) is not None or key == "dtype"]
    parts.append("sizes=" + json.dumps(record.get("sizes") or [], separators=(",", ":")))
    return " ".join(parts)


@functools.lru_cache(maxsize=4096)
def parse_collective_desc(desc: str) -> dict[str, Any]:
    """The fields of a description (``op``, ``group``, ``ranks`` as a list, ``peer``, ``dtype``, ``sizes``).

    Descriptions written before ``ranks``/``peer`` existed (``sizes=[[2, 4]]`` with spaces) read too;
    a field that does not parse is left out.  Cached (a job repeats a few shapes thousands of times): the dict
    returned is shared, not to be changed."""
    head, _, sizes = desc.partition(" sizes=")
    words = head.split(" ")
    out: dict[str, Any] = {"op": words[0]}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if sep and key in _FIELDS:
            out[key] = value
    if "ranks" in out:
        try:
            out["ranks"] = [int(r) for r in out["ranks"].split(",")]
        except ValueError:
            del out["ranks"]
    if out.get("dtype") == "None":
        out["dtype"] = None
    try:
        parsed = json.loads(sizes) if sizes else []
        out["sizes"] = parsed if isinstance(parsed, list) else []
    except (ValueError, RecursionError):
        out["sizes"] = []
    return out

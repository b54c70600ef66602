"""The training-health monitor's part of a ring and of a bundle: its last steps of every series, and its anomalies.

Pure: ring slots or a bundle's file in, dataclasses out.  In the ring (two optional rings, laid out while the env
config's ``monitor`` section is on; ``layout.SIDE_RINGS``, so they are not events):

==================  ===================================  ======  ===================  ====================  =========
ring, kind          a                                    b       c                    d                     flags
==================  ===================================  ======  ===================  ====================  =========
``monitor``,        id of the series' key                step    the steps to keep    the value (float64)   -
MONITOR_VALUE                                                    (``ring_steps``)
``monitor_anomaly``, id of the series' key + rule         step    baseline (float64)   the value (float64)   score
MONITOR_ANOMALY                                                                                              (float16)
==================  ===================================  ======  ===================  ====================  =========

A series' key is ``prefix\\x1fname\\x1fmicro\\x1fstat`` (the CSV file's prefix and row, micro empty when none) in the
ring's string table; an anomaly's adds ``\\x1frule``.  The ``monitor`` ring is sized for ``ring_steps`` steps of
``ring_series`` series; a ring that wrapped loses its oldest step (it may be partly overwritten).

In a bundle: ``monitor.json`` (:data:`FILE`), written by :func:`encode` and read back by :func:`decode`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ANOMALY_SLOTS", "FILE", "FORMAT", "SEP", "MonitorPart", "RingAnomaly", "RingSeries", "decode", "encode",
           "from_contents", "series_key"]

FILE = "monitor.json"
FORMAT = "obs-monitor-ring"
SCHEMA_VERSION = 1
SEP = "\x1f"
#: anomalies the ring keeps (the newest; a run that flags more loses its oldest, counted in the bundle)
ANOMALY_SLOTS = 4096


def series_key(prefix: str, name: str, micro: int | None, stat: str) -> str:
    """A series' key in the ring's string table."""
    return SEP.join((prefix, name, "" if micro is None else str(micro), stat))


@dataclass(frozen=True)
class RingSeries:
    """One series' values at the part's ``steps`` (None where the step has no value of it)."""

    prefix: str
    name: str
    micro: int | None
    stat: str
    values: tuple[float | None, ...]


@dataclass(frozen=True)
class RingAnomaly:
    """One value the monitor flagged while the run went on, judged against the run's whole history."""

    step: int
    prefix: str
    name: str
    micro: int | None
    stat: str
    value: float
    baseline: float
    rule: str
    score: float


@dataclass(frozen=True)
class MonitorPart:
    """The monitor's last ``steps`` (ascending; at most ``steps_kept``, the ``ring_steps`` in force) and the newest
    anomalies the ring held; ``dropped_anomalies``: older anomalies overwritten."""

    steps: tuple[int, ...]
    series: tuple[RingSeries, ...]
    anomalies: tuple[RingAnomaly, ...]
    steps_kept: int
    dropped_anomalies: int = 0


def _split(text: str, parts: int) -> list[str] | None:
    cut = text.split(SEP)
    return cut if len(cut) == parts else None


def _micro(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


def from_contents(strings: list[str], side: dict[str, np.ndarray], dropped: dict[str, int]) -> MonitorPart | None:
    """The part held by a ring's side rings (``RingContents.strings``, ``.side``, ``.dropped``); None without any."""
    values = side.get("monitor")
    flagged = side.get("monitor_anomaly")
    if (values is None or not len(values)) and (flagged is None or not len(flagged)):
        return None

    def text(sid: int) -> str | None:
        return strings[sid] if 0 <= sid < len(strings) else None

    steps: list[int] = []
    series: dict[str, dict[int, float]] = {}
    keep = 0
    if values is not None and len(values):
        keep = int(values["c"].max())
        step_of = values["b"]
        distinct = np.unique(step_of)
        if dropped.get("monitor", 0) > 0 and len(distinct) > 1:
            distinct = distinct[1:]  # the oldest step of a wrapped ring may be partly overwritten
        distinct = distinct[-keep:] if keep > 0 else distinct
        chosen = values[np.isin(step_of, distinct)]
        floats = chosen["d"].view("<f8")
        for sid, step, value in zip(chosen["a"].tolist(), chosen["b"].tolist(), floats.tolist()):
            key = text(sid)
            if key is not None and _split(key, 4) is not None:
                series.setdefault(key, {})[step] = value
        steps = distinct.tolist()
    out_series = []
    for key, by_step in series.items():
        prefix, name, micro, stat = key.split(SEP)
        out_series.append(RingSeries(prefix, name, _micro(micro), stat, tuple(by_step.get(s) for s in steps)))
    anomalies = []
    if flagged is not None and len(flagged):
        baselines, found = flagged["c"].view("<f8").tolist(), flagged["d"].view("<f8").tolist()
        scores = flagged["flags"].astype("<u2").view("<f2").astype(float).tolist()
        for sid, step, baseline, value, score in zip(flagged["a"].tolist(), flagged["b"].tolist(), baselines, found,
                                                     scores):
            key = text(sid)
            cut = _split(key, 5) if key is not None else None
            if cut is not None:
                anomalies.append(RingAnomaly(step, cut[0], cut[1], _micro(cut[2]), cut[3], value, baseline, cut[4],
                                             score))
    return MonitorPart(tuple(steps), tuple(out_series), tuple(anomalies), keep, dropped.get("monitor_anomaly", 0))


def _num(value: float | None) -> float | str | None:
    """JSON has no NaN or infinity: they are written as strings, read back as floats."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def encode(part: MonitorPart) -> str:
    """``monitor.json``: the part as one JSON document."""
    return json.dumps({
        "format": FORMAT, "schema_version": SCHEMA_VERSION, "steps_kept": part.steps_kept, "steps": list(part.steps),
        "dropped_anomalies": part.dropped_anomalies,
        "series": [{"series": s.prefix, "name": s.name, "micro": s.micro, "stat": s.stat,
                    "values": [_num(v) for v in s.values]} for s in part.series],
        "anomalies": [{"step": a.step, "series": a.prefix, "name": a.name, "micro": a.micro, "stat": a.stat,
                       "value": _num(a.value), "baseline": _num(a.baseline), "rule": a.rule, "score": _num(a.score)}
                      for a in part.anomalies]}, separators=(",", ":"))


class _Bad(ValueError):
    pass


def _float(value: Any, where: str) -> float:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"{where} must be a number (got {value!r:.40})")
    return float(value)


def _int(value: Any, where: str, *, none: bool = False) -> Any:
    if none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{where} must be an integer (got {value!r:.40})")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{where} must be a string (got {value!r:.40})")
    return value


def decode(data: Any, path: str) -> MonitorPart:
    """``monitor.json``'s parsed document, every field checked; :class:`DamagedFileError` names the file and field."""
    from obs._core.errors import DamagedFileError

    try:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise _Bad(f"not an obs monitor part (expected an object with \"format\": \"{FORMAT}\")")
        steps = [_int(s, f"steps[{i}]") for i, s in enumerate(data.get("steps") or [])]
        series = []
        for i, s in enumerate(data.get("series") or []):
            where = f"series[{i}]"
            if not isinstance(s, dict) or not isinstance(s.get("values"), list) or len(s["values"]) != len(steps):
                raise _Bad(f"{where} must be an object whose 'values' has one entry per step ({len(steps)})")
            series.append(RingSeries(_str(s.get("series"), f"{where}.series"), _str(s.get("name"), f"{where}.name"),
                                     _int(s.get("micro"), f"{where}.micro", none=True),
                                     _str(s.get("stat"), f"{where}.stat"),
                                     tuple(None if v is None else _float(v, f"{where}.values[{j}]")
                                           for j, v in enumerate(s["values"]))))
        anomalies = []
        for i, a in enumerate(data.get("anomalies") or []):
            where = f"anomalies[{i}]"
            if not isinstance(a, dict):
                raise _Bad(f"{where} must be an object")
            anomalies.append(RingAnomaly(
                _int(a.get("step"), f"{where}.step"), _str(a.get("series"), f"{where}.series"),
                _str(a.get("name"), f"{where}.name"), _int(a.get("micro"), f"{where}.micro", none=True),
                _str(a.get("stat"), f"{where}.stat"), _float(a.get("value"), f"{where}.value"),
                _float(a.get("baseline"), f"{where}.baseline"), _str(a.get("rule"), f"{where}.rule"),
                _float(a.get("score"), f"{where}.score")))
        return MonitorPart(tuple(steps), tuple(series), tuple(anomalies),
                           _int(data.get("steps_kept", 0), "steps_kept"),
                           _int(data.get("dropped_anomalies", 0), "dropped_anomalies"))
    except _Bad as exc:
        raise DamagedFileError(f"{path}: {exc}", path=path) from None

"""The monitor's files read back, pure: a run folder (msprobe's layout, obs's or msprobe's own) to dataclasses.

:func:`find_run` turns a path (a run folder, or a root of run folders) into one run folder; :func:`read_run` reads
its CSV files into one :class:`Series` per (file prefix, name, micro step, statistic).  Damaged files are a
:class:`~obs._core.errors.DamagedFileError` naming the file and line; a cut last line (a run killed while writing)
is left out and said in ``problems``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from obs._core.errors import DamagedFileError, NotOurFileError
from obs.features.monitor.layout import CSV_HEADER, CSV_PATTERN, META, RUN_FOLDER, is_micro, kind_stage
from recorder.monitor_part import RingAnomaly

__all__ = ["MonitorRun", "Series", "find_run", "is_run", "list_runs", "newest_write", "read_meta", "read_run"]

_LIMIT = 1 << 30  # bytes of one CSV file read at most


@dataclass(frozen=True)
class Series:
    """One statistic of one tensor across steps: ``steps[i]`` holds ``values[i]``, steps ascending."""

    prefix: str
    name: str
    micro: int | None
    stat: str
    kind: str
    stage: str
    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class MonitorRun:
    """A run folder read back: its series, ``monitor.json`` (``meta``; {} for msprobe's own runs), what was skipped."""

    folder: str
    rank: int | None
    meta: dict[str, Any]
    series: list[Series]
    problems: list[str] = field(default_factory=list)
    #: the anomalies the worker flagged while the run went on (an RDR bundle's part), ordered by ``explain`` instead of
    #: judging the series again; None for a run folder (judged again by ``explain``)
    recorded: tuple[RingAnomaly, ...] | None = None

    @property
    def steps(self) -> list[int]:
        return sorted({s for series in self.series for s in series.steps})


def _csv_files(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if CSV_PATTERN.fullmatch(n))


def find_run(path: str) -> tuple[str, list[str]]:
    """The run folder ``path`` names: itself when it holds monitor CSV files, else the newest run folder under it
    (msprobe's ``{time}-rank{r}-{id}`` names, searched two levels down).  Also returns the other run folders found."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    if not os.path.isdir(path):
        raise NotOurFileError(f"{path} is not a monitor output folder (give a run folder or the folder of runs)",
                              path=path)
    if _csv_files(path):
        return path, []
    runs = list_runs(path)
    runs.sort(key=_newest)
    return runs[-1], runs[:-1]


def is_run(path: str) -> bool:
    """``path`` is a run folder itself (it holds monitor CSV files), not a root of runs."""
    return os.path.isdir(path) and bool(_csv_files(path))


def list_runs(path: str) -> list[str]:
    """Every run folder under the root ``path`` (msprobe's ``{time}-rank{r}-{id}`` names holding CSV files, searched
    two levels down), sorted by name; NotOurFileError when there is none."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    if not os.path.isdir(path):
        raise NotOurFileError(f"{path} is not a monitor output folder (give a run folder or the folder of runs)",
                              path=path)
    runs = []
    for top, dirs, _ in os.walk(path):
        if top.count(os.sep) - path.rstrip(os.sep).count(os.sep) >= 2:
            dirs[:] = []
        for d in dirs:
            full = os.path.join(top, d)
            if RUN_FOLDER.fullmatch(d) and _csv_files(full):
                runs.append(full)
    if not runs:
        raise NotOurFileError(f"no monitor run under {path} (no {{prefix}}_{{a}}-{{b}}.csv files, nor run folders "
                              "{time}-rank{r}-{id} holding them)", path=path)
    return sorted(runs)


def newest_write(folder: str) -> float:
    """The newest modification time of the run's CSV files (0 with none)."""
    return _newest(folder)


def _newest(folder: str) -> float:
    return max((os.stat(os.path.join(folder, n)).st_mtime for n in _csv_files(folder)), default=0.0)


def _number(text: str, path: str, line: int, column: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise DamagedFileError(f"{path}:{line}: column {column!r} must be a number (got {text[:40]!r})",
                               path=path) from None


def read_meta(folder: str, *, checked: bool = True) -> dict[str, Any]:
    """The run folder's ``monitor.json`` ({} where it has none); ``checked``: its format and settings checked too.
    A file that is no JSON object is an error naming it."""
    meta_path = os.path.join(folder, META)
    if not os.path.exists(meta_path):
        return {}
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.loads(fh.read(1 << 24))
    except (OSError, ValueError, RecursionError) as exc:
        raise DamagedFileError(f"{meta_path}: not readable JSON ({exc})", path=meta_path) from None
    if not isinstance(meta, dict) or (checked and meta.get("format") != "obs-monitor"):
        raise DamagedFileError(f"{meta_path}: not an obs monitor metadata file", path=meta_path)
    return _checked_meta(meta, meta_path) if checked else meta


def read_run(folder: str) -> MonitorRun:
    """Every series of the run folder ``folder``."""
    meta = read_meta(folder)
    match = RUN_FOLDER.fullmatch(os.path.basename(os.path.normpath(folder)))
    rank = meta.get("rank") if isinstance(meta.get("rank"), int) else (int(match.group(2)) if match else None)
    data: dict[tuple[str, str, int | None, str], dict[int, float]] = {}
    problems: list[str] = []
    for name in _csv_files(folder):
        m = CSV_PATTERN.fullmatch(name)
        assert m is not None
        _read_csv(os.path.join(folder, name), m.group(1), data, problems)
    series = []
    for (prefix, name, micro, stat), by_step in data.items():
        steps = sorted(by_step)
        kind, stage = kind_stage(prefix, name)
        series.append(Series(prefix, name, micro, stat, kind, stage, tuple(steps), tuple(by_step[s] for s in steps)))
    return MonitorRun(folder, rank, meta, series, problems)


def _checked_meta(meta: dict[str, Any], path: str) -> dict[str, Any]:
    """``monitor.json``'s settings, modules and parameters checked as the settings' table checks them."""
    from obs.settings.monitor_options import MONITOR_OPTIONS

    settings = meta.get("settings", {})
    if not isinstance(settings, dict):
        raise DamagedFileError(f"{path}: 'settings' must be an object", path=path)
    checked = {}
    for key, value in settings.items():
        if key in MONITOR_OPTIONS:
            try:
                checked[key] = MONITOR_OPTIONS[key].check(value, key)
            except (ValueError, TypeError) as exc:
                raise DamagedFileError(f"{path}: {exc}", path=path) from None
    for key in ("modules", "params"):
        names = meta.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DamagedFileError(f"{path}: {key!r} must be a list of names", path=path)
    if meta.get("rank") is not None and (not isinstance(meta["rank"], int) or isinstance(meta["rank"], bool)):
        raise DamagedFileError(f"{path}: 'rank' must be an integer", path=path)
    return {**meta, "settings": checked}


def _read_csv(path: str, prefix: str, data: dict[Any, dict[int, float]], problems: list[str]) -> None:
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read(_LIMIT)
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"{path}: not UTF-8 text (byte offset {exc.start})", path=path) from None
    if "\x00" in text:
        raise DamagedFileError(f"{path}: holds a NUL byte (offset {text.index(chr(0))})", path=path)
    if not text:
        return
    cut = not text.endswith("\n")
    lines = text.splitlines()
    if cut:
        problems.append(f"{path}: its last line is cut (a run ended while writing it); left out")
        lines = lines[:-1]
    rows = list(csv.reader(lines))
    if not rows:
        return
    header = rows[0]
    lead = list(CSV_HEADER) + (["micro_step"] if is_micro(prefix) else [])
    if header[:len(lead)] != lead:
        if header[:2] == ["name", "step"] or header[:3] == ["vpp_stage", "name", "step"]:
            lead = header[:3] if header[0] == "vpp_stage" else header[:2]
            lead += ["micro_step"] if len(header) > len(lead) and header[len(lead)] == "micro_step" else []
        else:
            raise NotOurFileError(f"{path}: not a monitor CSV file (its header starts {header[:4]}, expected "
                                  f"{lead})", path=path)
    stats = header[len(lead):]
    has_micro = "micro_step" in lead
    for line, row in enumerate(rows[1:], 2):
        if len(row) != len(header):
            raise DamagedFileError(f"{path}:{line}: {len(row)} columns where the header has {len(header)}",
                                   path=path)
        at = lead.index("name")
        name = row[at]
        step = _number(row[lead.index("step")], path, line, "step")
        if not (math.isfinite(step) and step.is_integer()):
            raise DamagedFileError(f"{path}:{line}: step must be an integer (got {row[lead.index('step')]!r})",
                                   path=path)
        micro = None
        if has_micro:
            value = _number(row[len(lead) - 1], path, line, "micro_step")
            if not (math.isfinite(value) and value.is_integer()):
                raise DamagedFileError(f"{path}:{line}: micro_step must be an integer", path=path)
            micro = int(value)
        for stat, cell in zip(stats, row[len(lead):]):
            if stat in ("shape", "dtype"):
                continue
            value = _number(cell, path, line, stat)
            data.setdefault((prefix, name, micro, stat), {})[int(step)] = value if not math.isnan(value) else math.nan

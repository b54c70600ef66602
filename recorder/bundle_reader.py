"""Read RDR bundles: list them, load one, stream its events.  Pure: files in, dataclasses out.

Every file is opened with :func:`obs._core.safe_files.open_private` (no symlink, only a regular file
of this user).  A damaged file ends in :class:`DamagedFileError` naming the file and the byte
offset; a folder or file that is not a bundle in :class:`NotOurFileError`.  Listing goes on past
bad bundles and rings and reports them (:attr:`Listing.damaged`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError, UnsafePathError
from obs._core.json_files import is_int, parse_json, read_json
from recorder.bundle import SCHEMA_VERSION, TMP_PREFIX
from recorder.device_fault_reader import DeviceFault, read_device_fault
from recorder.monitor_part import FILE as MONITOR_FILE
from recorder.monitor_part import MonitorPart, decode
from recorder.ring_files import RingFile, find_rings, near

__all__ = ["EVENT_KINDS", "Bundle", "BundleInfo", "Listing", "Selection", "find_bundle", "list_bundles", "load_bundle",
           "parse_json", "read_monitor_part"]

#: every kind of event a bundle's events.jsonl holds
EVENT_KINDS = ("step_begin", "step_end", "phase", "module_enter", "module_exit", "op", "memory", "memory_peak",
               "collective", "print", "fault", "settings", "graph", "marker")

#: errors that make one bundle or ring unreadable (listing reports them and goes on)
BAD_FILE = (DamagedFileError, NotOurFileError, UnsafePathError, OSError)

_JSON_LIMIT = 1 << 26  # bytes of a manifest, exception or stacks file: far more than a dump writes


@dataclass(frozen=True)
class BundleInfo:
    """One line of ``obs rdr ls``."""

    path: str
    reason: str
    created_ns: int
    rank: int
    pid: int
    step: int
    run_id: str
    recovered: bool

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass
class Listing:
    """Bundles newest first, plus what else is there: rings to recover, interrupted dumps, and the bundles
    and rings that could not be read (``damaged``: their errors, each naming its file) or are not ours
    (``skipped``)."""

    bundles: list[BundleInfo] = field(default_factory=list)
    rings: list[RingFile] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    damaged: list[Exception] = field(default_factory=list)
    skipped: list[Exception] = field(default_factory=list)


@dataclass(frozen=True)
class Selection:
    """Events of a bundle that match a filter: ``events`` (only the last N when asked) of ``matched`` in all."""

    events: list[dict[str, Any]]
    matched: int


def _read_json(path: str, what: str, expect: type | None = None) -> Any:
    return read_json(path, what=what, limit=_JSON_LIMIT, expect=expect)


@dataclass
class Bundle:
    """A loaded bundle: its manifest and the small payloads; events are streamed on demand."""

    info: BundleInfo
    manifest: dict[str, Any]
    exception: dict[str, Any] | None
    stacks: list[dict[str, Any]]
    fatal_stacks: str
    graphs: list[str]
    device_fault: DeviceFault | None = None  #: a CUDA fault's explanation (recorder.device_fault_reader)
    monitor: MonitorPart | None = None  #: the training-health monitor's last steps and anomalies (monitor.json)

    def events(self, kinds: set[str] | None = None, last: int | None = None,
               step: int | None = None) -> list[dict[str, Any]]:
        """Events in order, optionally only ``kinds`` and ``step``, optionally only the ``last`` N (memory
        bounded by N)."""
        return self.pick(kinds, last, step).events

    def pick(self, kinds: set[str] | None = None, last: int | None = None, step: int | None = None, *,
             first: int | None = None) -> Selection:
        """:meth:`events`, or only the ``first`` N, with how many events matched in all (memory bounded by N)."""
        keep: deque[dict[str, Any]] | list[dict[str, Any]] = deque(maxlen=last) if last else []
        matched = 0
        for event in self.select(kinds, step):
            if first is None or matched < first:
                keep.append(event)
            matched += 1
        return Selection(list(keep), matched)

    def select(self, kinds: set[str] | None = None, step: int | None = None) -> Iterator[dict[str, Any]]:
        """The events of ``kinds`` and ``step`` (None: any), streamed: memory stays bounded by one event."""
        for event in self.iter_events():
            if (kinds is None or event["kind"] in kinds) and (step is None or event.get("step") == step):
                yield event

    def has(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.info.path, name))

    def newest_steps(self, name: str, steps: int) -> list[dict[str, Any]]:
        """The events of file ``name`` (in order) of its newest ``steps`` steps and the one before, read from the
        end: a long run's older lines are not parsed."""
        path = os.path.join(self.info.path, name)
        if not os.path.lexists(path):
            return []
        data = safe_files.read_private(path)
        out: list[dict[str, Any]] = []
        newest: int | None = None
        end = len(data)
        while end > 0:
            start = data.rfind(b"\n", 0, end - 1) + 1
            line = data[start:end]
            end = start
            if not line.strip():
                continue
            event = parse_json(line, path, base=start)
            if not isinstance(event, dict) or not is_int(event.get("t")) or not is_int(event.get("step")):
                raise DamagedFileError(f"{path}: byte {start} is not an event with an integer t and step: "
                                       f"{_short(line)}", path=path, offset=start)
            step: int = event["step"]
            newest = step if newest is None else newest
            if step < newest - steps:
                break
            out.append(event)
        out.reverse()
        return out

    def iter_events(self, name: str = "events.jsonl") -> Iterator[dict[str, Any]]:
        """Each event of ``events.jsonl`` (or of another file of events: ``collectives.jsonl``, ``steps.jsonl``,
        ``faults.jsonl``): a dict with an int ``seq`` and ``t`` and a str ``kind``.

        An event without a ``step`` (op events of bundles written before events carried one) gets
        the step of the latest step event before it; a damaged line is a :class:`DamagedFileError`."""
        path = os.path.join(self.info.path, name)
        if not os.path.lexists(path):
            return
        fd = safe_files.open_private(path)
        step: int | None = None
        with os.fdopen(fd, "rb") as fh:
            offset = 0
            for number, line in enumerate(fh, start=1):
                at, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                event = parse_json(line, path, base=at)
                if not isinstance(event, dict) or not isinstance(event.get("kind"), str) \
                        or not is_int(event.get("seq")) or not is_int(event.get("t")):
                    raise DamagedFileError(f"{path}: line {number} (byte {at}) is not an event (an object with an "
                                           f"integer seq and t and a kind): {_short(line)}", path=path, offset=at)
                if event["kind"] in ("step_begin", "step_end") and is_int(event.get("step")):
                    step = event["step"]
                elif "step" not in event and step is not None:
                    event["step"] = step
                yield event


def _short(data: bytes) -> str:
    text = data.decode("utf-8", "replace").strip()
    return repr(text if len(text) <= 80 else text[:60] + f"…[{len(text)} chars]")


#: manifest key → (accepted types, default); a value of another type makes the manifest damaged
_FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "reason": ((str,), "?"), "created_ns": ((int,), 0), "rank": ((int,), 0), "pid": ((int,), 0),
    "step": ((int,), 0), "run_id": ((str, type(None)), ""), "recovered": ((bool,), False),
    "host": ((str, type(None)), None), "world_size": ((int, type(None)), None),
    "granularity": ((str, type(None)), None), "versions": ((dict, type(None)), None),
    "settings": ((dict, type(None)), None), "dropped": ((dict, type(None)), None),
    "recorded": ((dict, type(None)), None), "last_module": ((str, type(None)), None),
    "open_modules": ((list, type(None)), None), "last_op": ((dict, type(None)), None),
    "fault": ((dict, type(None)), None), "exception": ((dict, type(None)), None), "files": ((list,), []),
    "monitor": ((dict, type(None)), None),
}


def _manifest(path: str) -> dict[str, Any]:
    file = os.path.join(path, "manifest.json")
    if not os.path.lexists(file):
        raise NotOurFileError(f"{path!r} is not an RDR bundle (no manifest.json); list bundles with `obs rdr ls`",
                              path=path)
    data: dict[str, Any] = _read_json(file, "an RDR manifest", dict)
    if "schema_version" not in data:
        raise NotOurFileError(f"{file}: not an RDR manifest (no schema_version)", path=file)
    version = data["schema_version"]
    if not is_int(version) or version < 1:
        raise DamagedFileError(f"{file}: schema_version must be a whole number >= 1 (got {_short_value(version)})",
                               path=file, offset=0)
    if version > SCHEMA_VERSION:
        raise NotOurFileError(f"{file}: schema_version {version} is newer than this obs reads ({SCHEMA_VERSION}); "
                              "upgrade obs", path=file)
    for key, (types, _default) in _FIELDS.items():
        value = data.get(key, _default)
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise DamagedFileError(f"{file}: manifest key {key!r} must be {names} (got {_short_value(value)})",
                                   path=file, offset=0)
    return data


def _short_value(value: Any) -> str:
    from obs._core.errors import shorten

    return shorten(value, 80)


def _info(path: str, manifest: dict[str, Any]) -> BundleInfo:
    get = {key: manifest.get(key, default) for key, (_types, default) in _FIELDS.items()}
    return BundleInfo(path, get["reason"], get["created_ns"], get["rank"], get["pid"], get["step"],
                      get["run_id"] or "", get["recovered"])


def list_bundles(path: str) -> Listing:
    """Every bundle under ``path`` (a tree of ``rank_*/rdr`` folders, one rdr folder, or one bundle).

    A bundle or ring that cannot be read is reported in ``damaged`` (or ``skipped``) and the rest is
    still listed."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such folder: {path!r}")
    listing = Listing()
    own = [os.path.join(path, "manifest.json")] if os.path.lexists(os.path.join(path, "manifest.json")) else []
    for file in near(path, "*/manifest.json") + own:
        folder = os.path.dirname(file)
        if os.path.basename(folder).startswith(TMP_PREFIX):
            continue
        try:
            listing.bundles.append(_info(folder, _manifest(folder)))
        except NotOurFileError as exc:
            listing.skipped.append(exc)
        except BAD_FILE as exc:
            listing.damaged.append(exc)
    listing.incomplete += near(path, TMP_PREFIX + "*")
    listing.bundles.sort(key=lambda b: b.created_ns, reverse=True)
    for ring in find_rings(path):
        if ring.error is not None:
            listing.damaged.append(ring.error)
        elif not ring.alive:
            listing.rings.append(ring)
    return listing


def find_bundle(path: str) -> str:
    """``path`` itself if it is a bundle; the newest bundle under it if it is a folder of them; for
    ``.../latest`` the newest bundle beside it."""
    if os.path.lexists(os.path.join(path, "manifest.json")):
        return path
    base = os.path.dirname(path) if os.path.basename(path.rstrip("/")) == "latest" and not os.path.exists(path) \
        else path
    if os.path.isdir(base):
        listing = list_bundles(base)
        if listing.bundles:
            return listing.bundles[0].path
        if listing.damaged:
            raise listing.damaged[0]
        raise NotOurFileError(f"no RDR bundle under {base!r}", path=base)
    raise FileNotFoundError(f"no such bundle: {path!r}")


def _exception(path: str) -> dict[str, Any] | None:
    file = os.path.join(path, "exception.json")
    if not os.path.lexists(file):
        return None
    data = _read_json(file, "an exception record")
    if not isinstance(data, dict) or not isinstance(data.get("traceback", ""), str) \
            or not all(isinstance(data.get(k, ""), str) for k in ("type", "message")):
        raise DamagedFileError(f"{file}: not an exception record (an object with string type, message and "
                               "traceback)", path=file, offset=0)
    return data


def _stacks(path: str) -> list[dict[str, Any]]:
    file = os.path.join(path, "stacks.json")
    if not os.path.lexists(file):
        return []
    data = _read_json(file, "a bundle's stacks")
    if not isinstance(data, list):
        raise DamagedFileError(f"{file}: stacks must be a JSON list of threads", path=file, offset=0)
    for i, thread in enumerate(data):
        ok = isinstance(thread, dict) and isinstance(thread.get("thread"), str) \
            and isinstance(thread.get("frames"), list) \
            and all(isinstance(f, dict) and isinstance(f.get("file"), str) and isinstance(f.get("function"), str)
                    and (f.get("line") is None or is_int(f.get("line"))) and isinstance(f.get("code", ""), str)
                    for f in thread["frames"])
        if not ok:
            raise DamagedFileError(f"{file}: thread {i} is not a stack (an object with a string thread and frames "
                                   "of file, line, function)", path=file, offset=0)
    return data


def load_bundle(path: str) -> Bundle:
    """Load ``path`` (see :func:`find_bundle` for what it may name)."""
    path = find_bundle(path)
    manifest = _manifest(path)
    fatal = os.path.join(path, "fatal_stacks.txt")
    fatal_text = safe_files.read_private(fatal).decode("utf-8", "replace") if os.path.lexists(fatal) else ""
    graphs_dir = os.path.join(path, "graphs")
    graphs = sorted(os.path.join(graphs_dir, g) for g in os.listdir(graphs_dir)) \
        if os.path.isdir(graphs_dir) and not os.path.islink(graphs_dir) else []
    return Bundle(_info(path, manifest), manifest, _exception(path), _stacks(path), fatal_text, graphs,
                  read_device_fault(path), read_monitor_part(path))


def read_monitor_part(path: str) -> MonitorPart | None:
    """The monitor's part of the bundle at ``path`` (its folder, or its ``monitor.json``); None when it has none."""
    file = path if os.path.basename(path) == MONITOR_FILE else os.path.join(path, MONITOR_FILE)
    if not os.path.lexists(file):
        return None
    return decode(_read_json(file, "a bundle's monitor part", dict), file)

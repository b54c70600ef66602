"""Read RDR bundles: list them, load one, stream its events.  Pure: files in, dataclasses out."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from recorder.bundle import SCHEMA_VERSION
from recorder.recover import RingFile, find_rings, near

__all__ = ["Bundle", "BundleInfo", "Listing", "find_bundle", "list_bundles", "load_bundle"]


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
    """Bundles newest first, plus what else is there: rings to recover and interrupted dumps."""

    bundles: list[BundleInfo] = field(default_factory=list)
    rings: list[RingFile] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)


@dataclass
class Bundle:
    """A loaded bundle: its manifest and the small payloads; events are streamed on demand."""

    info: BundleInfo
    manifest: dict[str, Any]
    exception: dict[str, Any] | None
    stacks: list[dict[str, Any]]
    fatal_stacks: str
    graphs: list[str]

    def events(self, kinds: set[str] | None = None, last: int | None = None) -> list[dict[str, Any]]:
        """Events in order, optionally only ``kinds``, optionally only the ``last`` N (memory bounded by N)."""
        keep: deque[dict[str, Any]] | list[dict[str, Any]] = deque(maxlen=last) if last else []
        for event in self.iter_events():
            if kinds is None or event.get("kind") in kinds:
                keep.append(event)
        return list(keep)

    def iter_events(self) -> Iterator[dict[str, Any]]:
        path = os.path.join(self.info.path, "events.jsonl")
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as exc:
                        raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None



def _info(path: str, manifest: dict[str, Any]) -> BundleInfo:
    return BundleInfo(path, str(manifest.get("reason", "?")), int(manifest.get("created_ns", 0)),
                      int(manifest.get("rank", 0)), int(manifest.get("pid", 0)), int(manifest.get("step", 0)),
                      str(manifest.get("run_id", "")), bool(manifest.get("recovered", False)))


def _manifest(path: str) -> dict[str, Any]:
    file = os.path.join(path, "manifest.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not an RDR bundle (no manifest.json); list bundles with `obs rdr ls`")
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except ValueError as exc:
        raise ValueError(f"{file}: manifest is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise ValueError(f"{file}: not an RDR manifest (no schema_version)")
    if data["schema_version"] > SCHEMA_VERSION:
        raise ValueError(f"{file}: schema_version {data['schema_version']} is newer than this obs reads "
                         f"({SCHEMA_VERSION}); upgrade obs")
    return data


def list_bundles(path: str) -> Listing:
    """Every bundle under ``path`` (a tree of ``rank_*/rdr`` folders, one rdr folder, or one bundle)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such folder: {path!r}")
    listing = Listing()
    for file in near(path, "*/manifest.json") + ([os.path.join(path, "manifest.json")]
                                                 if os.path.isfile(os.path.join(path, "manifest.json")) else []):
        folder = os.path.dirname(file)
        if os.path.basename(folder).startswith(".tmp-"):
            continue
        try:
            listing.bundles.append(_info(folder, _manifest(folder)))
        except ValueError:
            listing.incomplete.append(folder)
    listing.incomplete += near(path, ".tmp-*")
    listing.bundles.sort(key=lambda b: b.created_ns, reverse=True)
    listing.rings = [r for r in find_rings(path) if not r.alive]
    return listing


def find_bundle(path: str) -> str:
    """``path`` itself if it is a bundle; the newest bundle under it if it is a folder of them; for
    ``.../latest`` the newest bundle beside it."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    base = os.path.dirname(path) if os.path.basename(path.rstrip("/")) == "latest" and not os.path.exists(path) \
        else path
    if os.path.isdir(base):
        bundles = list_bundles(base).bundles
        if bundles:
            return bundles[0].path
        raise ValueError(f"no RDR bundle under {base!r}")
    raise FileNotFoundError(f"no such bundle: {path!r}")


def load_bundle(path: str) -> Bundle:
    """Load ``path`` (see :func:`find_bundle` for what it may name)."""
    path = find_bundle(path)
    manifest = _manifest(path)

    def read(name: str) -> str:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return ""
        with open(file, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    exception = json.loads(read("exception.json")) if read("exception.json") else None
    stacks = json.loads(read("stacks.json")) if read("stacks.json") else []
    graphs = sorted(os.path.join(path, "graphs", g) for g in os.listdir(os.path.join(path, "graphs"))) \
        if os.path.isdir(os.path.join(path, "graphs")) else []
    return Bundle(_info(path, manifest), manifest, exception, stacks, read("fatal_stacks.txt"), graphs)

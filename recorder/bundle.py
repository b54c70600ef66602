"""Write an RDR bundle: a folder that is complete or absent, private, never overwriting another.

``{rdr_dir}/{UTC stamp}_{pid}_{reason}/`` holds ``manifest.json`` plus the payload files.  The
folder is built under a hidden temporary name and renamed into place, so a crash (or a kill)
during a dump leaves no half bundle.  Folders are 0700, files 0600, created without following
symlinks; names built from reasons are sanitized.  No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, Union

__all__ = ["SCHEMA_VERSION", "bundle_name", "safe_name", "write_bundle", "write_json_atomic"]

SCHEMA_VERSION = 1
Payload = Union[str, bytes, Iterable[str]]


def safe_name(text: str, limit: int = 64) -> str:
    """``text`` reduced to ``[A-Za-z0-9_.-]`` (no path separators, no leading dot), at most ``limit`` long."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "unnamed"
    return cleaned[:limit]


def bundle_name(reason: str, pid: int, now_ns: int | None = None) -> str:
    now_ns = time.time_ns() if now_ns is None else now_ns
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns // 1_000_000_000))
    return f"{stamp}.{now_ns // 1000 % 1_000_000:06d}Z_{pid}_{safe_name(reason)}"


def _write(path: str, payload: Payload) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        if isinstance(payload, bytes):
            fh.write(payload)
        elif isinstance(payload, str):
            fh.write(payload.encode())
        else:
            lines = list(payload)
            if lines:
                fh.write("\n".join(lines).encode())
                fh.write(b"\n")


def write_bundle(rdr_dir: str, name: str, manifest: Mapping[str, Any], files: Mapping[str, Payload]) -> str:
    """Create ``rdr_dir/name`` atomically with ``manifest.json`` and ``files`` (relative names, may hold one
    folder level such as ``graphs/x.ir``); a taken name gets a ``-2``, ``-3``… suffix.  Returns the path."""
    os.makedirs(rdr_dir, mode=0o700, exist_ok=True)
    final = os.path.join(rdr_dir, name)
    n = 1
    while os.path.lexists(final):
        n += 1
        final = os.path.join(rdr_dir, f"{name}-{n}")
    tmp = os.path.join(rdr_dir, f".tmp-{os.path.basename(final)}")
    os.mkdir(tmp, 0o700)
    for rel, payload in files.items():
        folder, base = os.path.split(rel)
        if folder:
            os.makedirs(os.path.join(tmp, safe_name(folder)), mode=0o700, exist_ok=True)
            rel = os.path.join(safe_name(folder), safe_name(base, 128))
        else:
            rel = safe_name(base, 128)
        _write(os.path.join(tmp, rel), payload)
    listing = sorted(os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs)
    _write(os.path.join(tmp, "manifest.json"), json.dumps({**manifest, "files": listing}, indent=2, default=str))
    os.rename(tmp, final)
    return final


def write_json_atomic(path: str, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON (0600) through a temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2, default=str)
    os.replace(tmp, path)

"""Write an RDR bundle: a folder that is complete or absent, private, never overwriting another.

``{rdr_dir}/{UTC stamp}_{pid}_{reason}/`` holds ``manifest.json`` plus the payload files.  The
folder is built under a hidden temporary name and renamed into place after every file is fsynced
(:func:`obs._core.safe_files.new_folder`), so a crash (or a kill) during a dump leaves no half
bundle.  Every folder and file goes through :mod:`obs._core.safe_files`: folders 0700, files 0600
created with ``O_EXCL|O_NOFOLLOW``, no symlink followed in a folder others can write to.  Names
built from reasons are sanitized.  No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from obs._core import safe_files

__all__ = ["SCHEMA_VERSION", "bundle_name", "write_bundle", "write_json_atomic"]

SCHEMA_VERSION = 1
Payload = str | bytes | Iterable[str]
TMP_PREFIX = safe_files.TMP_FOLDER_PREFIX  #: an interrupted dump's folder (the readers skip and report it)


def bundle_name(reason: str, pid: int, now_ns: int | None = None) -> str:
    now_ns = time.time_ns() if now_ns is None else now_ns
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns // 1_000_000_000))
    return f"{stamp}.{now_ns // 1000 % 1_000_000:06d}Z_{pid}_{safe_files.safe_name(reason)}"


def _write(path: str, payload: Payload, *, fsync: bool) -> None:
    fd = safe_files.create_file(path)
    with os.fdopen(fd, "wb") as fh:
        if isinstance(payload, bytes):
            fh.write(payload)
        elif isinstance(payload, str):
            fh.write(payload.encode("utf-8", "surrogateescape"))
        else:
            lines = list(payload)
            if lines:
                fh.write("\n".join(lines).encode("utf-8", "surrogateescape"))
                fh.write(b"\n")
        fh.flush()
        if fsync:
            os.fsync(fd)


def write_bundle(rdr_dir: str, name: str, manifest: Mapping[str, Any], files: Mapping[str, Payload], *,
                 fsync: bool = True) -> str:
    """Create ``rdr_dir/name`` atomically with ``manifest.json`` and ``files`` (relative names, may hold one
    folder level such as ``graphs/x.ir``); a taken name gets a ``-2``, ``-3``… suffix.  Returns the path.

    With ``fsync`` (the default) every file and both folders are on disk when this returns, so a
    caller may then delete what the bundle was made from (the ring).  On any error the temporary
    folder is removed and the error propagates; nothing else is touched.
    """

    def fill(tmp: str) -> None:
        written = []
        for rel, payload in files.items():
            folder, base = os.path.split(rel)
            if folder:
                sub = os.path.join(tmp, safe_files.safe_name(folder))
                if not os.path.isdir(sub):
                    os.mkdir(sub, safe_files.DIR_MODE)
                rel = os.path.join(safe_files.safe_name(folder), safe_files.safe_name(base, limit=128))
            else:
                rel = safe_files.safe_name(base, limit=128)
            _write(os.path.join(tmp, rel), payload, fsync=fsync)
            written.append(rel)
        _write(os.path.join(tmp, "manifest.json"),
               json.dumps({**manifest, "files": sorted(set(written))}, indent=2, default=str), fsync=fsync)

    return safe_files.new_folder(rdr_dir, safe_files.safe_name(name, limit=200), fill, fsync=fsync)


def write_json_atomic(path: str, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON (0600) through an unpredictably named temporary file
    (``O_EXCL|O_NOFOLLOW``) and a rename: a file planted under any name is never written through."""
    safe_files.write_atomic(path, json.dumps(data, indent=2, default=str))

"""Write an RDR bundle: a folder that is complete or absent, private, never overwriting another.

``{rdr_dir}/{UTC stamp}_{pid}_{reason}/`` holds ``manifest.json`` plus the payload files.  The
folder is built under a hidden temporary name (unpredictable, created by ``mkdir``, so nothing can
be planted in it) and renamed into place after every file is fsynced, so a crash (or a kill)
during a dump leaves no half bundle.  Every folder and file goes through
:mod:`obs._core.safe_files`: folders 0700, files 0600 created with ``O_EXCL|O_NOFOLLOW``, no
symlink followed in a folder others can write to.  Names built from reasons are sanitized.  No
pickle anywhere.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any

from obs._core import safe_files

__all__ = ["SCHEMA_VERSION", "bundle_name", "write_bundle", "write_json_atomic"]

SCHEMA_VERSION = 1
Payload = str | bytes | Iterable[str]
TMP_PREFIX = ".tmp-"  #: an interrupted dump's folder starts with this (the readers skip and report it)


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
    safe_files.ensure_dir(rdr_dir)
    final = os.path.join(rdr_dir, safe_files.safe_name(name, limit=200))
    n = 1
    while os.path.lexists(final):
        n += 1
        final = os.path.join(rdr_dir, f"{safe_files.safe_name(name, limit=200)}-{n}")
    tmp = os.path.join(rdr_dir, f"{TMP_PREFIX}{os.path.basename(final)}-{secrets.token_hex(6)}")
    os.mkdir(tmp, safe_files.DIR_MODE)  # fails if anything is there: nothing planted is reused
    try:
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
        listing = sorted(set(written))
        _write(os.path.join(tmp, "manifest.json"), json.dumps({**manifest, "files": listing}, indent=2, default=str),
               fsync=fsync)
        if fsync:
            for folder in {os.path.dirname(os.path.join(tmp, rel)) for rel in listing} | {tmp}:
                safe_files.fsync_dir(folder)
        os.rename(tmp, final)
    except BaseException:
        _remove_tree(tmp)
        raise
    if fsync:
        safe_files.fsync_dir(rdr_dir)
    return final


def _remove_tree(path: str) -> None:
    """Remove the temporary folder this module made (only regular files and one folder level inside)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def write_json_atomic(path: str, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON (0600) through an unpredictably named temporary file
    (``O_EXCL|O_NOFOLLOW``) and a rename: a file planted under any name is never written through."""
    safe_files.write_atomic(path, json.dumps(data, indent=2, default=str))

"""``obs rdr recover``: turn the ring of a process that died without dumping into a normal bundle.

A ring file outlives SIGKILL, OOM kills and segfaults; faulthandler's stacks of a fatal signal
sit next to it (``fatal_{pid}.txt``).  A recovered ring is renamed ``*.recovered`` so it is
recovered once; rings of processes still alive are left alone.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from recorder.bundle import bundle_name, write_bundle, write_json_atomic
from recorder.assemble import bundle_parts
from recorder.ring_reader import read_ring_file

__all__ = ["RingFile", "find_rings", "near", "recover_rings"]


@dataclass(frozen=True)
class RingFile:
    path: str
    pid: int
    alive: bool


#: where RDR files sit relative to what a user passes: an rdr folder, a rank folder, an RDR root,
#: or a folder of runs each with its root (bounded globs: never a walk of a whole tree)
_LEVELS = ("", "rdr", "rank_*/rdr", "*/rank_*/rdr", "*/*/rank_*/rdr")


def near(path: str, pattern: str) -> list[str]:
    """Files or folders matching ``pattern`` at the RDR levels under ``path``, sorted."""
    base = glob.escape(path)
    return sorted({f for level in _LEVELS for f in glob.glob(os.path.join(base, level, pattern))})


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_rings(path: str) -> list[RingFile]:
    """Ring files under ``path`` (or ``path`` itself), with whether their writer is still alive."""
    if os.path.isfile(path):
        candidates = [path]
    else:
        candidates = near(path, "ring_*.obsring")
    out = []
    for ring in candidates:
        stem = os.path.basename(ring).removeprefix("ring_").removesuffix(".obsring")
        pid = int(stem) if stem.isdigit() else -1
        out.append(RingFile(ring, pid, pid > 0 and _alive(pid)))
    return out


def recover_rings(path: str) -> list[str]:
    """Bundles (reason ``recovered``, or ``fatal_signal`` when faulthandler left stacks) for dead writers."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such rdr folder or ring file: {path!r}")
    made = []
    for ring in find_rings(path):
        if ring.alive:
            continue
        contents = read_ring_file(ring.path)
        folder = os.path.dirname(ring.path)
        fatal_path = os.path.join(folder, f"fatal_{ring.pid}.txt")
        fatal = ""
        if os.path.exists(fatal_path):
            with open(fatal_path, errors="replace") as fh:
                fatal = fh.read()
        reason = "fatal_signal" if fatal.strip() else "recovered"
        fault = {"kind": reason, "where": _first_line(fatal) or "process ended without dumping (SIGKILL, OOM kill?)"}
        manifest, files = bundle_parts(contents, reason, fault=fault, fatal_stacks=fatal or None, recovered=True)
        bundle = write_bundle(folder, bundle_name(reason, ring.pid), manifest, files)
        os.rename(ring.path, ring.path + ".recovered")
        if os.path.exists(fatal_path):
            os.rename(fatal_path, fatal_path + ".recovered")
        write_json_atomic(os.path.join(folder, "marker.json"), {
            "state": "recovered", "pid": ring.pid, "rank": contents.header.rank,
            "run_id": contents.header.meta.get("run_id"), "dumps": [os.path.basename(bundle)],
            "last_reason": reason, "last_bundle": os.path.basename(bundle)})
        made.append(bundle)
    return made


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""

"""``obs rdr recover``: turn the ring of a process that died without dumping into a normal bundle.

A ring file outlives SIGKILL, OOM kills and segfaults; faulthandler's stacks of a fatal signal
sit next to it (``fatal_{pid}.txt``, pid from the ring's header).  A recovered ring is renamed
``*.recovered`` so it is recovered once.

A ring whose writer's lock can be taken has no writer (:mod:`recorder.ring_files`); recover keeps
holding the lock while it converts the ring, so two recovers never make two bundles of one ring.
Every file is opened with :func:`obs._core.safe_files.open_private` (no symlink, a regular file of
this user).  A bad ring is reported and the others are still recovered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from obs._core import safe_files
from obs._core.errors import UnsafePathError
from recorder.assemble import bundle_parts
from recorder.bundle import bundle_name, write_bundle, write_json_atomic
from recorder.graph_texts import read_graphs
from recorder.ring_files import RING_ERRORS, candidates, writer_alive
from recorder.ring_reader import read_header_file, read_ring_file

__all__ = ["FATAL_LIMIT", "Recovery", "recover", "recover_rings"]

#: faulthandler's dump of all threads is a few KiB; more than this is not faulthandler's
FATAL_LIMIT = 1 << 20


@dataclass
class Recovery:
    """What :func:`recover` did: the bundles it made and what it could not recover (each error names its file)."""

    made: list[str] = field(default_factory=list)
    problems: list[Exception] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)  #: rings left alone because their writer runs


def recover(path: str) -> Recovery:
    """Bundles (reason ``recovered``, or ``fatal_signal`` when faulthandler left stacks) for every ring under
    ``path`` whose writer is gone.  One bad ring is reported in ``problems`` and the others go on."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no such rdr folder or ring file: {path!r}")
    result = Recovery()
    for ring in candidates(path):
        try:
            bundle = _recover_one(ring)
        except RING_ERRORS as exc:
            result.problems.append(exc)
            continue
        if bundle is None:
            result.alive.append(ring)
            continue
        made, problem = bundle
        result.made.append(made)
        if problem is not None:
            result.problems.append(problem)
    return result


def recover_rings(path: str) -> list[str]:
    """:func:`recover`, returning the bundles made; after recovering every ring it can, raises the first problem."""
    result = recover(path)
    if result.problems:
        raise result.problems[0]
    return result.made


def _recover_one(ring: str) -> tuple[str, Exception | None] | None:
    """The bundle made of ``ring`` and a problem with its fatal-signal file (None: the writer is alive)."""
    fd = safe_files.open_private(ring)
    try:
        if writer_alive(fd, read_header_file(ring, fd=fd).pid, keep=True):
            return None
        contents = read_ring_file(ring, fd=fd)
        pid = contents.header.pid
        folder = os.path.dirname(ring)
        fatal_path = os.path.join(folder, f"fatal_{pid}.txt")
        fatal = ""
        problem: Exception | None = None
        if os.path.lexists(fatal_path):
            try:
                fatal = safe_files.read_private(fatal_path, limit=FATAL_LIMIT).decode("utf-8", "replace")
            except (UnsafePathError, OSError) as exc:
                problem = exc  # the ring is still recovered; the refused file is neither read nor renamed
        reason = "fatal_signal" if fatal.strip() else "recovered"
        fault = {"kind": reason, "where": _first_line(fatal) or "process ended without dumping (SIGKILL, OOM kill?)"}
        if problem is not None:
            fault["fatal_stacks_refused"] = str(problem)
        graphs_dir = os.path.join(folder, f"graphs_{pid}")
        graphs, refused = read_graphs(graphs_dir)  # the graph texts the recorder kept beside its ring
        if refused and problem is None:
            problem = refused[0]
        manifest, files = bundle_parts(contents, reason, fault=fault, fatal_stacks=fatal or None, recovered=True,
                                       graphs=graphs)
        bundle = write_bundle(folder, bundle_name(reason, pid), manifest, files)
        os.rename(ring, ring + ".recovered")  # only once the bundle is on disk (write_bundle fsyncs)
        if graphs and not os.path.islink(graphs_dir):
            os.rename(graphs_dir, graphs_dir + ".recovered")
        if fatal and problem is None:
            os.rename(fatal_path, fatal_path + ".recovered")
        write_json_atomic(os.path.join(folder, "marker.json"), {
            "state": "recovered", "pid": pid, "rank": contents.header.rank,
            "run_id": contents.header.meta.get("run_id"), "dumps": [os.path.basename(bundle)],
            "last_reason": reason, "last_bundle": os.path.basename(bundle)})
        return bundle, problem
    finally:
        os.close(fd)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""

"""This rank's Prometheus target, announced through file service discovery: Prometheus finds every rank on its own.

Each exporter process that serves Prometheus writes one file, ``{output}/prometheus_sd/{node}_{pid}.json``, in
the format of Prometheus' ``file_sd_configs``::

    [{"targets": ["node7:9465"], "labels": {"run_id": "...", "rank": "9", "local_rank": "1", "node": "node7"}}]

The labels become target labels of every series scraped from the rank.  The file is replaced atomically (a fresh
temporary file in the same folder, fsynced, renamed over the old one: a reader sees the old or the new file, on
NFS too, where a rename within one folder is atomic on the server) and every process writes its own file, so no
two writers ever share one.  It is rewritten when the trainer learns its rank and the job's run id, and removed
when the exporter ends (the rank ended).  A rank whose exporter was killed leaves its file: Prometheus keeps
scraping the dead address, and ``up == 0`` is what the ``ObsExporterDown`` rule alerts on.
"""

from __future__ import annotations

import json
import os
import socket

from obs._core import safe_files

__all__ = ["FOLDER", "TargetFile", "target_address"]

#: the folder under the profiler's output root that holds the targets of every rank writing there
FOLDER = "prometheus_sd"
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def target_address(host: str, port: int, node: str) -> str:
    """The ``host:port`` Prometheus scrapes: an endpoint listening on every interface is reached by the node's name."""
    if host in _WILDCARDS:
        host = node
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{host}:{port}"


class TargetFile:
    """One exporter's file-SD entry under ``folder``; :meth:`write` (again on each change) and :meth:`remove`."""

    def __init__(self, folder: str, *, pid: int, node: str | None = None) -> None:
        self.node = node or socket.gethostname()
        self.path = os.path.join(folder, f"{safe_files.safe_name(self.node)}_{pid}.json")
        self._written: str | None = None

    def write(self, address: str, *, run_id: str, rank: int, local_rank: int) -> bool:
        """Announce ``address`` with this rank's labels (nothing is written when they did not change); False when the
        file cannot be written (the error is raised as OSError)."""
        entry = [{"targets": [address], "labels": {"run_id": run_id, "rank": str(rank), "local_rank": str(local_rank),
                                                    "node": self.node}}]
        text = json.dumps(entry, indent=1) + "\n"
        if text == self._written:
            return False
        safe_files.ensure_dir(os.path.dirname(self.path))
        safe_files.write_atomic(self.path, text, fsync=True)
        self._written = text
        return True

    def remove(self) -> None:
        """The rank ended: Prometheus drops its target at its next read of the folder."""
        if self._written is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._written = None

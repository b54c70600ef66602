"""Each collected step's wall time, so that the runs of a job's ranks can be lined up (``obs monitor explain`` over a
job's root).

* :class:`StepTimes`: the monitor worker's ``on_step`` (:class:`~obs.features.monitor.writer.Worker`): it appends
  ``step,time_ns`` to ``step_times.csv`` in the run folder, the wall clock when the training thread handed the step
  over, right after ``optimizer.step()`` (:attr:`~obs.features.monitor.writer.Packet.t`).  msprobe's CSV files are
  left as they are (its tools match ``{prefix}_{a}-{b}.csv``; this name does not).
* :func:`read_times`: that file read back (pure).
* :func:`host_offsets`: each host's clock against the lowest rank's, as ``obs rdr analyze`` computes them
  (:mod:`recorder.arrival`): ranks on one host share its clock; between hosts, the median difference of a moment all
  ranks share.  There it is when a collective ends; here the end of the same optimizer step, which in synchronous
  data parallel training follows the gradients' all-reduce on every rank.
* :func:`identity`: what ``monitor.json`` adds for it (host, the launcher's job id); at the first step
  :class:`StepTimes` corrects its rank and world size from torch.distributed when the monitor started before
  ``init_process_group`` without being told the rank, and adds the pipeline stage where Megatron's parallel state
  knows it (:func:`pipeline_stage`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
from collections.abc import Mapping
from typing import Any

from obs._core import safe_files
from obs._core.errors import DamagedFileError
from obs._core.internal import report_internal_error
from obs.features.monitor.layout import META

__all__ = ["BATCH", "TIMES", "StepTimes", "host_offsets", "identity", "pipeline_stage", "read_times"]

TIMES = "step_times.csv"
BATCH = 16  #: lines a write: the worker writes each step's CSV rows already, this file need not cost one more
_HEADER = "step,time_ns\n"
_LIMIT = 1 << 28


def identity() -> dict[str, Any]:
    """``monitor.json``'s keys for lining ranks up: ``host``, and ``job`` (the launcher's job id, torchrun's
    ``--rdzv-id``) when there is one."""
    from obs.runtime import job

    out: dict[str, Any] = {"host": socket.gethostname()}
    run_id = job.launcher_run_id()
    if run_id is not None:
        out["job"] = run_id
    return out


class StepTimes:
    """Writes ``step_times.csv``: one line per collected step, :data:`BATCH` lines a write (and the rest at close);
    the file is opened once, appended to."""

    def __init__(self, folder: str, meta: dict[str, Any] | None = None) -> None:
        self.folder = folder
        self.meta = meta  #: the collector's meta (what it sends to monitor.json), corrected at the first step
        self._fd: int | None = None
        self._last = -1
        self._lines: list[str] = []

    def __call__(self, step: int, t: int) -> None:
        if step == self._last:  # one line per step
            return
        self._last = step
        if self._fd is None:
            try:
                self._settle()
            except Exception as exc:  # noqa: BLE001 - reported; the step times are written all the same
                report_internal_error("monitor: rank and pipeline stage", exc)
            path = os.path.join(self.folder, TIMES)
            if os.path.lexists(path):
                self._fd = safe_files.open_append(path, what="monitor step times")
            else:
                self._fd = safe_files.create_file(path, append=True, folder_ready=True)
                os.write(self._fd, _HEADER.encode())
        self._lines.append(f"{step},{t}\n")
        if len(self._lines) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if self._fd is not None and self._lines:
            lines, self._lines = self._lines, []
            os.write(self._fd, "".join(lines).encode())

    def _settle(self) -> None:
        """At the first step, into ``monitor.json``: torch.distributed's rank and world size when the monitor started
        before ``init_process_group`` under a launcher that does not say the rank (``torch.multiprocessing.spawn``,
        Lightning's: the run folder keeps its name, the file says the rank, and the reader takes the file's); and the
        pipeline stage (``pp_stage``) where Megatron's parallel state knows it."""
        if self.meta is None:
            return
        found: dict[str, int] = {}
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            found.update(rank=int(dist.get_rank()), world_size=int(dist.get_world_size()))
        stage = pipeline_stage()
        if stage is not None:
            found["pp_stage"] = stage
        changed = {k: v for k, v in found.items() if self.meta.get(k) != v}
        if not changed:
            return
        self.meta.update(changed)  # the collector's later copies say it too
        path = os.path.join(self.folder, META)
        with open(path, encoding="utf-8") as fh:
            body = json.load(fh)
        body.update(changed)
        safe_files.write_atomic(path, json.dumps(body, indent=1), fsync=False)

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def pipeline_stage() -> int | None:
    """This rank's pipeline stage, from Megatron's parallel state (Megatron-Core or Megatron-LM's ``mpu``, as msprobe
    takes it) when the process imported it and initialised model parallelism; else None.  Nothing is imported."""
    for name in ("megatron.core.parallel_state", "megatron.core.mpu"):
        mpu = sys.modules.get(name)
        if mpu is None:
            continue
        try:
            if mpu.model_parallel_is_initialized():
                return int(mpu.get_pipeline_model_parallel_rank())
        except Exception:  # noqa: BLE001 - another version's API: no stage, the run goes on
            return None
    return None


def read_times(folder: str) -> dict[int, int]:
    """``step -> time_ns`` of a run folder ({} without the file: msprobe's own runs, obs before it).  A damaged line
    is an error naming the file and line; a cut last line (a run killed while writing) is left out."""
    path = os.path.join(folder, TIMES)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(_LIMIT)
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise DamagedFileError(f"{path}: not readable ({exc})", path=path) from None
    lines = text.splitlines()
    if not text.endswith("\n"):
        lines = lines[:-1]
    if not lines:
        return {}
    if lines[0] != _HEADER.strip():
        raise DamagedFileError(f"{path}: not a monitor step times file (its first line is {lines[0][:40]!r}, "
                               f"expected {_HEADER.strip()!r})", path=path)
    out: dict[int, int] = {}
    for number, line in enumerate(lines[1:], 2):
        step, _, t = line.partition(",")
        if not (step.isdigit() and t.isdigit()):
            raise DamagedFileError(f"{path}:{number}: expected 'step,time_ns' as two integers (got {line[:60]!r})",
                                   path=path)
        out[int(step)] = int(t)
    return out


def host_offsets(hosts: Mapping[int, str], times: Mapping[int, Mapping[int, int]]) -> dict[str, int]:
    """Each host's clock minus the lowest rank's host's (ns): the median, over the steps both hold, of a rank's step
    time less the lowest rank's.  ``hosts``: rank -> host; ``times``: rank -> step -> time_ns.  A host with no step in
    common with the reference gets 0 (not lined up)."""
    if not hosts:
        return {}
    ref_rank = min(hosts)
    ref_host, ref = hosts[ref_rank], times.get(ref_rank, {})
    out = {ref_host: 0}
    by_host: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        by_host.setdefault(hosts[rank], []).append(rank)
    for host, ranks in by_host.items():
        if host == ref_host:
            continue
        diffs = [t - ref[s] for r in ranks for s, t in times.get(r, {}).items() if s in ref]
        out[host] = int(statistics.median(diffs)) if diffs else 0
    return out

"""Job identity: which job this process belongs to and its place in it, one answer for every feature that names it
(the Running Data Recorder's rings and bundles, the profiler's ring and spans).

- The run id: the launcher's job id (:func:`launcher_run_id`), else the id the ranks agreed on once torch.distributed
  is up (:func:`agree_run_id`), else this process's :data:`PROPOSAL`, which is not the job's yet (torchrun says
  ``none`` without ``--rdzv-id``; ``torch.multiprocessing.spawn`` and Lightning's launcher say nothing).  Once agreed,
  the id is kept for the process: a feature started later takes it at once.
- The rank and world size: :func:`obs.settings.parallel.rank` and ``world_size`` (torch.distributed's once it is up);
  whether the rank is known before ``init_process_group``: :func:`obs.settings.parallel.rank_given`.
- The versions a bundle or a trace names: obs, Python, torch.

torch is never imported here: torch.distributed counts once the process has imported and initialised it.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass

from obs._core import env
from obs.settings import parallel

__all__ = ["PROPOSAL", "RUN_ID_KEY", "JobIdentity", "agree_run_id", "distributed_rank", "distributed_ready", "identity",
           "launcher_run_id", "versions"]

#: this process's proposal for the job's run id, until the ranks agree on one
PROPOSAL = uuid.uuid4().hex[:12]
#: the key under which the ranks of a job agree on its run id (in the default process group's store)
RUN_ID_KEY = "obs/run_id"
_agreed: list[str] = []  # the run id the ranks agreed on, once they have


@dataclass(frozen=True)
class JobIdentity:
    """Who this process is in its job, as known now (see the module's docstring)."""

    run_id: str
    run_id_known: bool  #: the run id is the job's (the launcher's or agreed), not this process's proposal
    rank: int
    world_size: int
    rank_known: bool  #: :func:`obs.settings.parallel.rank_given`: the rank is this process's, not a guess
    versions: dict[str, str]


def identity() -> JobIdentity:
    """The job identity in force: what a recorder or a profiling session starts with."""
    run_id, known = _run_id()
    return JobIdentity(run_id=run_id, run_id_known=known, rank=parallel.rank(), world_size=parallel.world_size(),
                       rank_known=parallel.rank_given(), versions=versions())


def launcher_run_id() -> str | None:
    """The launcher's job id: ``TORCHELASTIC_RUN_ID``, unless torchrun's placeholder ``none`` (no ``--rdzv-id``)."""
    value = env.text(env.TORCHELASTIC_RUN_ID).strip()
    return value if value and value.lower() != "none" else None


def _run_id() -> tuple[str, bool]:
    given = launcher_run_id()
    if given is not None:
        return given, True
    if _agreed:
        return _agreed[0], True
    return PROPOSAL, False


def agree_run_id() -> str | None:
    """The job's run id, agreed with the other ranks if need be; None while torch.distributed is not up.

    The first rank to ask writes its :data:`PROPOSAL` into the default group's store (an atomic compare-and-set: no
    rank waits for another); every rank reads back the winner and keeps it for the process."""
    run_id, known = _run_id()
    if known:
        return run_id
    dist = parallel.distributed()
    if dist is None:
        return None
    store = dist.distributed_c10d._get_default_store()
    value = store.compare_set(RUN_ID_KEY, "", PROPOSAL)
    _agreed[:] = [bytes(value).decode("utf-8", "replace") or PROPOSAL]
    return _agreed[0]


def distributed_ready() -> bool:
    """torch.distributed is initialised in this process: from now on it gives the rank and world size."""
    return parallel.distributed() is not None


def distributed_rank() -> tuple[int, int] | None:
    """(rank, world size) from torch.distributed once it is up, else None."""
    return (parallel.rank(), parallel.world_size()) if distributed_ready() else None


def versions() -> dict[str, str]:
    """The versions of obs, Python and torch (``not installed`` without it; read without importing it)."""
    import platform
    from importlib import metadata

    from obs._core.version import __version__

    torch = sys.modules.get("torch")
    try:
        torch_version = torch.__version__ if torch is not None else metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {"obs": __version__, "python": platform.python_version(), "torch": str(torch_version)}

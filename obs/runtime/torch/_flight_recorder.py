"""PyTorch's Flight Recorder, armed and read: the collectives issued from C++ (DDP's buckets) without a Python hook.

torch.distributed records each collective a process group issues (gloo since torch 2.8; ``collective_seq_id``,
op, sizes, dtypes, retired or not) in a process-wide buffer whose size it reads from ``TORCH_FR_BUFFER_SIZE``
(formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) when the first process group is made; torch 2.13 keeps 2,000 entries
when neither is set, 0 turns it off.  :func:`arm` sets the size where the user did not, before any group
exists; :func:`records` says whether a group's collectives are in the buffer (DDP's relay is the fallback where
not); :func:`add_to_bundle` reads the buffer at dump time (no stacks: a copy under the recorder's own mutex,
which a collective blocked in gloo does not hold) and merges what obs did not record itself.

NCCL is untested (no GPU here): in CUDA builds its groups may record into a CUDA-event recorder that
``_dump_fr_trace`` does not return (``_dump_nccl_trace``); :func:`records` then says no and DDP keeps the relay.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from typing import Any

__all__ = ["BUFFER_SIZE", "add_to_bundle", "arm", "records"]

BUFFER_SIZE = 2000  #: entries kept, torch's own default
_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_log = logging.getLogger("obs")
_members: dict[str, str] = {}  #: a subgroup's ranks by group name, kept past destroy_process_group
_default_name: list[str] = []
_said: set[str] = set()


def arm() -> bool:
    """Set ``TORCH_FR_BUFFER_SIZE`` for the process groups made from now on (children inherit it), unless the user
    set a size (0 included) or a group exists already (it was read then).  True when the size is ours now."""
    if any(v in os.environ for v in _VARS):
        return False
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None and getattr(c10d, "_world", None) is not None and c10d._world.pg_map:
        return False
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(BUFFER_SIZE)
    return True


def _dump() -> dict[str, Any]:
    from torch._C import _distributed_c10d as c

    dump = getattr(c, "_dump_fr_trace", None)
    if dump is None:  # a torch without an in-process Flight Recorder
        return {}
    raw = dump(includeCollectives=True, includeStackTraces=False)
    return pickle.loads(raw) if raw else {}  # noqa: S301 - bytes torch itself just made, in this process


def records(group: Any) -> bool:
    """Whether the Flight Recorder records ``group``'s collectives (its status is kept, or an entry of it is in the
    buffer).  Called once per DDP model, after its constructor's own collectives; remembers the group's ranks."""
    _remember(group)
    try:
        dump = _dump()
    except Exception:  # noqa: BLE001 - an older torch, or no Flight Recorder: the relay records the buckets
        return False
    name = str(getattr(group, "group_name", ""))
    if name in (dump.get("pg_status") or {}):
        return True
    return any(str((e.get("process_group") or ("",))[0]) == name for e in dump.get("entries") or ())


def say_once(key: str, level: int, message: str) -> None:
    """Log ``message`` the first time ``key`` is said in this process."""
    if key not in _said:
        _said.add(key)
        _log.log(level, message)


def _remember(group: Any = None) -> None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return
    try:
        if c10d.is_initialized():
            default = c10d._get_default_group()
            if not _default_name:
                _default_name.append(str(default.group_name))
            for pg, name in list(c10d._world.pg_names.items()):
                if pg is not default and name not in _members:
                    _members[name] = ",".join(str(r) for r in sorted(c10d._world.pg_group_ranks.get(pg, {})))
    except Exception:  # noqa: BLE001 - a group torch no longer knows: entries of it are recorded without members
        pass


def add_to_bundle(files: dict[str, Any]) -> int:
    """Merge the Flight Recorder's entries that obs did not record into a bundle's files (see
    :mod:`recorder.flight_recorder`); returns how many were added.  Nothing when torch.distributed is not in use."""
    if "torch.distributed" not in sys.modules:
        return 0
    from recorder.flight_recorder import entry_record, merge_entries

    _remember()
    if not _default_name:  # no process group was seen: nothing PyTorch issued (and no buffer made early)
        return 0
    dump = _dump()
    status = dump.get("pg_status") or {}
    default = _default_name[0] if _default_name else None
    found = [entry_record(e, default_name=default, members=_members, status=status)
             for e in dump.get("entries") or ()]
    return merge_entries(files, [r for r in found if r is not None])

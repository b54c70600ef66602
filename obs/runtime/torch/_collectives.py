"""torch.distributed collectives → COLLECTIVE events: sequence number per group, op, sizes, dtype, state, timing.

While COLLECTIVE has subscribers, the public collective functions of ``torch.distributed`` are
wrapped (both names: ``torch.distributed.X`` and ``distributed_c10d.X``).  DDP's gradient buckets are
recorded as they are issued by a communication hook (:mod:`obs.runtime.torch._ddp`,
:meth:`CollectiveHooks.bucket_all_reduce`); the other collectives PyTorch issues from C++ (DDP's start-up
broadcasts) come from its Flight Recorder at dump time (:mod:`obs.runtime.torch._flight_recorder`).

The arguments are read by the function's real signature (worked out once per function), so a
group passed by position is recorded as that group.  A collective's sequence number is its process
group's own (the Flight Recorder's ``collective_seq_id``): the n-th collective of a group on every
member rank has the same number, which is how ``obs rdr analyze`` lines ranks up, and the wrappers'
records and the Flight Recorder's entries of one collective have the same one.  Point-to-point ops count
on their own per pair of ranks (group ``{group}:p2p:{lo}-{hi}``), so they never shift the
group's numbers.  A rank outside the group (the call is a no-op for it) records nothing.

States: a blocking call publishes ``started`` then ``completed`` (or ``failed`` when it raised),
with its duration; an ``async_op=True`` call (and isend/irecv) publishes ``scheduled``, and
``completed`` / ``failed`` from a callback of its Work's future when the work completes.  On a
device (CUDA tensors: NCCL) the call returns, and the future completes, before the device has run
the collective, so there a blocking call is issued async and waited for as c10d would, and the
work's completion (``is_completed``, from device events) is polled at the next collective and at
each step boundary: a collective still running on the device stays ``started``.

While the profiler times on the device (:data:`obs.runtime.device_time.current`), such a blocking call is timed
with CUDA events on the caller's current stream: one recorded before the call, one after ``work.wait()`` (which
makes that stream wait for the collective), so its device time runs from when the stream reached the call to when
the collective was done there, waiting for the other ranks included.  An ``async_op=True`` call, and DDP's buckets,
run on the backend's own stream until someone waits: they are not timed.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.compiler import is_compiling
from torch.distributed import distributed_c10d as c10d

from obs._core.events import Event, bus
from obs._core.internal import report_internal_error
from obs.runtime import device_time
from obs.runtime.steps import tracker
from obs.runtime.torch import _flight_recorder
from obs.runtime.torch._ddp import DdpHooks, scale
from obs.runtime.torch._p2p import Peer, same_ops
from recorder.layout import DeviceTarget

__all__ = ["CollectiveHooks", "OPS", "remap_torchs_own"]

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter", "send", "recv",
       "isend", "irecv")
_P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
_GROUP_PEER = {name: f"group_{arg}" for name, arg in _P2P.items()}  #: the peer as the group's rank
_COLLECTIVE = DeviceTarget.COLLECTIVE
_ASYNC_ALWAYS = frozenset({"isend", "irecv"})


class _Args:
    """Where a function takes ``group``, ``async_op`` and its peer: worked out once from its signature."""

    __slots__ = ("names", "group", "async_op", "peer", "defaults")

    def __init__(self, name: str, function: Any) -> None:
        params = list(inspect.signature(function).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.group = self._index("group")
        self.async_op = self._index("async_op")
        self.peer = self._index(_P2P[name]) if name in _P2P else None

    def _index(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def replace(self, index: int, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) \
            -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with the parameter at ``index`` set to ``value`` (where the caller passed it)."""
        if index < len(args) and self.names[index] not in kwargs:
            return args[:index] + (value,) + args[index + 1:], kwargs
        return args, {**kwargs, self.names[index]: value}

    def get(self, index: int | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index is None:
            return None
        name = self.names[index]
        if name in kwargs:
            return kwargs[name]
        if index < len(args):
            return args[index]
        return self.defaults.get(name)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


class _Groups:
    """Names and member ranks of process groups, as every rank sees them (cached per group name)."""

    def __init__(self) -> None:
        self._members: dict[str, str] = {}

    def name(self, group: Any) -> str:
        """``default`` for the world group (None, ``group.WORLD`` or the default group object), else its
        ``group_name`` (the same on every rank: groups are made by every rank in the same order)."""
        if group is None or group is c10d.GroupMember.WORLD:
            return "default"
        name = getattr(group, "group_name", None)
        if name is None:
            return str(getattr(group, "group_desc", None) or id(group))
        try:
            if name == c10d._get_default_group().group_name:
                return "default"
        except (RuntimeError, ValueError):  # not initialised
            pass
        return str(name)

    def members(self, name: str, group: Any) -> str | None:
        """``0,2`` for a subgroup's global ranks (None for the world group)."""
        if name == "default":
            return None
        known = self._members.get(name)
        if known is None:
            try:
                known = ",".join(str(r) for r in dist.get_process_group_ranks(group))
            except Exception:  # noqa: BLE001 - a group torch no longer knows: record without members
                known = ""
            self._members[name] = known
        return known or None


class _Inside(threading.local):
    """Per thread: whether a wrapped collective is running (the ones it calls are not recorded again)."""

    def __init__(self) -> None:
        self.depth = 0


class CollectiveHooks:
    """Wraps the collectives (and DDP's construction) until ``remove()``."""

    def __init__(self) -> None:
        self._seq: defaultdict[str, itertools.count[int]] = defaultdict(lambda: itertools.count(1))
        self._p2p: defaultdict[str, int] = defaultdict(int)  #: point-to-point ops issued, per group
        self._groups = _Groups()
        self._inside = _Inside()
        self._pending: list[tuple[Any, dict[str, Any], int]] = []  #: device work whose completion is polled
        self._polling = False
        self._originals: dict[str, Any] = {}
        self._wrapped: dict[str, Any] = {}
        self._live = [True]  #: False once removed: a wrapper another tool wrapped again stays, passing through
        self._specs: dict[str, _Args] = {}
        self._buckets: dict[tuple[Any, ...], dict[str, Any]] = {}  #: a DDP bucket's record by group and shape
        remap_torchs_own()
        for name in OPS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._specs[name] = _Args(name, original)
            wrapped = self._wrap(name, original, self._specs[name])
            if name in _ASYNC_ALWAYS:  # isend/irecv: equal to torch's, as P2POp's checks need
                wrapped = Peer(name, wrapped, original)
            self._install(name, original, wrapped)
        batch = getattr(c10d, "batch_isend_irecv", None)
        if batch is not None:  # on record through its isend/irecv calls; wrapped only to hand them ours
            self._install("batch_isend_irecv", batch, _batch_wrapper(batch, self._live))
        _flight_recorder.arm()  # before init_process_group: DDP's C++ collectives go on record there
        self._ddp = DdpHooks(self.bucket_all_reduce)

    def _install(self, name: str, original: Any, wrapped: Any) -> None:
        self._originals[name], self._wrapped[name] = original, wrapped
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)

    def _wrap(self, name: str, original: Any, spec: _Args) -> Any:
        groups, seqs, p2p_issued = self._groups, self._seq, self._p2p
        always_async = name in _ASYNC_ALWAYS

        inside, pending, live = self._inside, self._pending, self._live

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            # traced by Dynamo: torch's own (remapped to its functional collective, the graph as without obs);
            # called by another wrapped collective (send → isend): one record per call; removed: torch's own
            if is_compiling() or inside.depth or not live[0]:
                return original(*args, **kwargs)
            try:
                group = spec.get(spec.group, args, kwargs)
                if group is not None and c10d._rank_not_in_group(group):
                    return original(*args, **kwargs)  # a no-op on this rank: nothing to line up
                if pending:
                    self.poll()
                record, tensors = _record(name, group, spec, args, kwargs, groups, seqs, p2p_issued)
                is_async = always_async or bool(spec.get(spec.async_op, args, kwargs))
                record["state"] = "scheduled" if is_async else "started"
                # A device backend (NCCL) returns, and completes the work's future, before the device ran
                # the collective: its completion is found by polling the work (is_completed: device events).
                polled = _device_work(tensors)
                call_args, call_kwargs = args, kwargs
                if polled and not is_async and spec.async_op is not None:
                    call_args, call_kwargs = spec.replace(spec.async_op, True, args, kwargs)
                bus.emit(Event.COLLECTIVE, dict(record))
            except Exception as exc:  # noqa: BLE001 - reported; the collective still runs
                report_internal_error(f"collective {name}", exc)
                return original(*args, **kwargs)
            blocking = call_args is not args or call_kwargs is not kwargs  # issued async, waited for here
            timer = device_time.current if blocking else None
            began = timer.begin() if timer is not None else None
            start = time.perf_counter_ns()
            inside.depth = 1
            try:
                result = original(*call_args, **call_kwargs)
                if polled and result is not None and hasattr(result, "is_completed"):
                    self._pend(result, record, start)
                    if blocking:  # the caller asked for a blocking call
                        result.wait()
                        result = None
                        if timer is not None and began is not None:
                            timer.end(began, _COLLECTIVE, name, tracker.step)
                            began = None
                    return result
            except BaseException as exc:
                if timer is not None and began is not None:
                    timer.cancel(began)
                    began = None
                if polled:
                    self._pending[:] = [p for p in self._pending if p[1] is not record]
                bus.emit(Event.COLLECTIVE, {**record, "state": "failed", "error": f"{type(exc).__name__}: {exc}",
                                            "duration_ns": time.perf_counter_ns() - start})
                raise
            finally:
                inside.depth = 0
                if timer is not None and began is not None:  # no work to wait for: nothing to time
                    timer.cancel(began)
            if not is_async or result is None:
                bus.emit(Event.COLLECTIVE, {**record, "state": "completed",
                                            "duration_ns": time.perf_counter_ns() - start})
            elif not _on_completion(result, record, start):  # no future (gloo's isend/irecv): polled
                self._pend(result, record, start)
            return result

        return collective

    def bucket_all_reduce(self, tensor: torch.Tensor, group: Any) -> Any:
        """A DDP gradient bucket reduced as DDP's reducer does (:func:`obs.runtime.torch._ddp.reduce`), on record as
        it is issued: ``scheduled`` now, ``completed`` / ``failed`` from the callback that also hands the bucket back
        to DDP.  A bucket's fields are worked out once per shape; then only its sequence number, per call."""
        pg = group if group is not None else c10d._get_default_group()
        scale(tensor, pg.size())
        try:
            key = (id(pg), tensor.shape, tensor.dtype)
            known = self._buckets.get(key)
            if known is None:
                record, _ = _record("all_reduce", group, self._specs["all_reduce"], (tensor,), {}, self._groups,
                                    self._seq, self._p2p)
                self._buckets[key] = record
            else:
                name = known["group"]
                record = {**known, "seq": _group_seq(group, self._seq[name], self._p2p[name])}
            record = {**record, "state": "scheduled"}
            bus.emit(Event.COLLECTIVE, record)
        except Exception as exc:  # noqa: BLE001 - reported; the collective still runs
            report_internal_error("DDP bucket all_reduce", exc)
            return pg.allreduce([tensor]).get_future().then(_first)
        start = time.perf_counter_ns()
        try:
            work = pg.allreduce([tensor])
        except BaseException as exc:
            bus.emit(Event.COLLECTIVE, {**record, "state": "failed", "error": f"{type(exc).__name__}: {exc}",
                                        "duration_ns": time.perf_counter_ns() - start})
            raise
        if _device_work([tensor]):
            self._pend(work, record, start)
            return work.get_future().then(_first)

        def done(future: Any) -> Any:
            elapsed = time.perf_counter_ns() - start
            try:
                value = future.value()
            except Exception as exc:
                bus.emit(Event.COLLECTIVE, {**record, "state": "failed", "error": f"{type(exc).__name__}: {exc}",
                                            "duration_ns": elapsed})
                raise
            bus.emit(Event.COLLECTIVE, {**record, "state": "completed", "duration_ns": elapsed})
            return value[0]

        return work.get_future().then(done)

    def _pend(self, work: Any, record: dict[str, Any], start: int) -> None:
        self._pending.append((work, record, start))
        if not self._polling:  # also at each step boundary, so a finished last collective shows completed
            from obs.runtime.steps import tracker

            tracker.at_boundary.add(self.poll)
            self._polling = True

    def poll(self) -> None:
        """Publish ``completed`` for the polled device work that has finished (in the order it was issued)."""
        still = []
        for work, record, start in list(self._pending):
            if work.is_completed():
                bus.emit(Event.COLLECTIVE, {**record, "state": "completed",
                                            "duration_ns": time.perf_counter_ns() - start})
            else:
                still.append((work, record, start))
        self._pending[:] = still

    def remove(self) -> None:
        if self._polling:
            from obs.runtime.steps import tracker

            tracker.at_boundary.remove(self.poll)
            self._polling = False
        self._live[0] = False
        for name, original in self._originals.items():
            wrapped = self._wrapped[name]
            # where another tool wrapped ours since (the monitor's cc), its wrapper stays: ours passes through
            if getattr(c10d, name) is wrapped:
                setattr(c10d, name, original)
            if getattr(dist, name, None) is wrapped:
                setattr(dist, name, original)
        self._originals, self._wrapped = {}, {}
        self._ddp.remove()


def remap_torchs_own() -> None:
    """Import torch's functional collectives before anything wraps the collectives: on import they take
    ``distributed_c10d``'s functions as the keys of the table by which Dynamo remaps a traced collective.  Imported
    under a wrapper (DDP's construction imports them), the table keeps the wrapper: a compiled collective then
    breaks the graph once the wrapper is gone, with obs off."""
    try:
        import torch.distributed._functional_collectives  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a torch without them: nothing to keep
        report_internal_error("functional collectives import", exc)


def _batch_wrapper(original: Any, live: list[bool]) -> Any:
    """batch_isend_irecv, its P2POps made with an isend/irecv from before obs wrapped them given obs's (torch tells
    an isend from an irecv by identity); torch's own once removed."""
    @functools.wraps(original)
    def batch_isend_irecv(*args: Any, **kwargs: Any) -> Any:
        if live[0] and not is_compiling():
            try:
                same_ops(args, kwargs)
            except Exception as exc:  # noqa: BLE001 - reported; torch's own checks follow
                report_internal_error("collective batch_isend_irecv", exc)
        return original(*args, **kwargs)

    return batch_isend_irecv


def _device_work(tensors: list[torch.Tensor]) -> bool:
    """Whether the collective runs on a device (CUDA: NCCL), whose work completes after the call returns."""
    return bool(tensors) and tensors[0].device.type != "cpu"


def _record(name: str, group: Any, spec: _Args, args: tuple[Any, ...], kwargs: dict[str, Any], groups: _Groups,
            seqs: defaultdict[str, itertools.count[int]], p2p_issued: defaultdict[str, int]) \
        -> tuple[dict[str, Any], list[torch.Tensor]]:
    tensors = _tensors(args, kwargs)
    key = groups.name(group)
    record: dict[str, Any] = {"op": name, "group": key}
    members = groups.members(key, group)
    if members is not None:
        record["ranks"] = members
    p2p = p2p_issued[key]
    if spec.peer is not None:
        p2p_issued[key] = p2p + 1  # the group's own number counts point-to-point ops, its collectives' does not
        peer = spec.get(spec.peer, args, kwargs)
        if peer is None:  # given as the group's rank (group_dst / group_src: batch_isend_irecv's way)
            peer = _global_peer(group, kwargs.get(_GROUP_PEER[name]))
        me = dist.get_rank()
        pair = "any" if peer is None else "-".join(str(r) for r in sorted((me, int(peer))))
        key = f"{key}:p2p:{pair}"
        record.update(group=key, peer="any" if peer is None else int(peer))
    seq = next(seqs[key]) if spec.peer is not None else _group_seq(group, seqs[key], p2p)
    record.update(seq=seq, sizes=[list(t.shape) for t in tensors[:4]],
                  dtype=str(tensors[0].dtype).removeprefix("torch.") if tensors else None, duration_ns=0)
    return record, tensors


def _global_peer(group: Any, group_peer: Any) -> int | None:
    """The global rank of ``group``'s rank ``group_peer`` (None when not given or not known)."""
    if group_peer is None:
        return None
    try:
        return int(c10d.get_global_rank(group if group is not None else c10d._get_default_group(), int(group_peer)))
    except Exception:  # noqa: BLE001 - a group torch does not know: no peer on record
        return None


def _group_seq(group: Any, own: itertools.count[int], p2p: int) -> int:
    """The number the process group gives the collective about to be issued (the Flight Recorder's
    ``collective_seq_id``: its entries and obs's records line up); obs's own count where the group has none.

    The group's sequence number counts every op it issued, the ``collective_seq_id`` only collectives: less the
    ``p2p`` point-to-point ops issued through the wrappers (one issued from C++ shifts it: gloo's
    ``monitored_barrier``)."""
    try:
        pg = group if group is not None else c10d._get_default_group()
        return int(pg._get_sequence_number_for_group()) + 1 - p2p
    except Exception:  # noqa: BLE001 - a backend without sequence numbers
        return next(own)


def _first(future: Any) -> Any:
    return future.value()[0]


def _on_completion(work: Any, record: dict[str, Any], start: int) -> bool:
    """Publish ``completed`` (or ``failed``) when ``work`` completes, from its future's callback; False when the work
    has no future (gloo's point-to-point works), and nothing is published."""

    def done(future: Any) -> None:
        elapsed = time.perf_counter_ns() - start
        try:
            future.value()
        except Exception as exc:  # noqa: BLE001 - the collective failed (a peer died, a timeout)
            bus.emit(Event.COLLECTIVE, {**record, "state": "failed", "error": f"{type(exc).__name__}: {exc}",
                                        "duration_ns": elapsed})
            return
        bus.emit(Event.COLLECTIVE, {**record, "state": "completed", "duration_ns": elapsed})

    try:
        future = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return False
    future.add_done_callback(done)
    return True

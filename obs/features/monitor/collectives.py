"""msprobe's ``cc`` for the monitor (``cc_distribution``): the statistics of the tensors of each collective called
through ``torch.distributed``'s Python API, per call, grouped per step.

While ``cc_distribution.enable`` is on, the collectives of msprobe's ``distributed_ops.yaml`` (and ``all_to_all``,
``all_to_all_single``) are wrapped under both their names (``torch.distributed.X`` and ``distributed_c10d.X``), as
msprobe wraps them; :meth:`Collectives.remove` puts the originals back (nothing is patched while off).  Each call of
a collected step (the monitor's ``start_step``/``step_interval``/``collect_times``) whose call site matches
``cc_codeline`` records, for each of its tensor arguments (a list of tensors, or of ``P2POp``, counts as one, as
msprobe stacks it), the statistics of ``ops``: before the call with ``cc_pre_hook`` (rows ``{op}/pre_{i}``; not of
an argument that only receives, such as all_gather's output list, whose memory is not yet written: msprobe measures
it too) and after it (``{op}/post_{i}``), ``i`` the argument's place among the call's tensor arguments in the
function's parameter order, as msprobe's tags (:mod:`obs.features.monitor.cc_calls`).  Rows go into msprobe's
``other`` file with a ``micro_step`` column: the op's call within the step (msprobe sums them into one row per op,
which hides which call moved).  An ``async_op=True`` call's ``post`` rows are taken when its work is waited
(``Work.wait`` is wrapped while on, as msprobe does); a work not waited by the step's optimizer step has no ``post``
rows.

A collective traced by ``torch.compile`` (Dynamo) is left to it: the wrapper calls torch's own function first thing
while compiling, so the graphs are those without obs, and such a call has no rows.

The statistics are torch ops on the tensors' own device (no host read: the step's values travel with the others',
:mod:`obs.features.monitor.batch`), under ``torch.no_grad()`` with obs's hooks suppressed, on the caller's stream
after (or before) the collective: they read the tensors and change nothing.

With ``cc_log_only`` no statistics are taken: each op's call sites (msprobe's ``expected_cc_log.json`` entries:
the tensor arguments' dtypes, the group's ranks, then the stack) are written once, after the first collected step
that called any, to ``cc_log.json`` in the run folder and logged; unlike msprobe, training goes on.

DDP's gradient buckets are reduced by its C++ reducer, outside the Python API: they are not in ``cc`` (msprobe does
not see them either); the reduced gradients are the monitor's ``grad_reduced`` rows, each rank's own its
``grad_unreduced`` ones.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
import threading
from typing import Any

import torch
from torch.compiler import is_compiling
from torch.optim import optimizer as torch_optimizer

from obs._core import safe_files
from obs._core.internal import report_internal_error, suppressed
from obs.features.monitor.batch import to_host
from obs.features.monitor.cc_calls import OPS, OUTPUT_ONLY, call_stack, described, tensor_args
from obs.features.monitor.stats import stats
from obs.features.monitor.step_plan import same_rows
from obs.features.monitor.writer import Block, Packet
from obs.runtime.torch import Peer, remap_torchs_own, same_ops

__all__ = ["LOG_FILE", "PREFIX", "Collectives"]

logger = logging.getLogger("obs")

PREFIX = "other"  #: msprobe's file of the collectives' rows
LOG_FILE = "cc_log.json"
Row = tuple[str, "int | None", str, str]


class Collectives:
    """The wrappers of one monitor run; the collector's extra block of each step (:meth:`__call__`)."""

    def __init__(self, collector: Any, section: dict[str, Any], folder: str | None) -> None:
        self.collector = collector
        plan = collector.plan
        self.ops, self.eps = plan.value_ops, plan.eps
        self.pre = bool(section.get("cc_pre_hook"))
        self.codeline = [re.compile(p) for p in section.get("cc_codeline") or ()]
        self.folder = folder
        self.log_only = bool(section.get("cc_log_only"))
        self.logged: dict[str, dict[str, None]] | None = {} if self.log_only else None  #: None: written
        self.active = True
        self._step = -1
        self.rows: list[Row] = []
        self.parts: list[torch.Tensor] = []
        self.calls: dict[str, int] = {}
        self._last_rows: tuple[Row, ...] = ()
        #: the ops in the order of their first recorded call: monitor.json's ``collectives`` (explain's order)
        self.order: dict[str, None] = {}
        self._new_order = False
        self._pending: dict[Any, tuple[str, int, list[Any]]] = {}
        self._inside = threading.local()
        self._lock = threading.Lock()  #: rows, parts and calls: appended by whichever thread calls a collective
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # name -> (original, wrapper)
        self._params: dict[str, tuple[str, ...]] = {}  # name -> its parameters' names
        self._wait: tuple[Any, Any] | None = None
        self._install()
        collector.extras.append(self)
        # after the collector's own: a step whose packet the collector did not send (no parameter watched: targets
        # that match none, as msprobe's example configs' "foo") still gets its rows, and cc_log_only its file
        self._handle = torch_optimizer.register_optimizer_step_post_hook(self._post_step)

    # -- install / remove -------------------------------------------------------------------------------
    def _install(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        c10d = dist.distributed_c10d
        remap_torchs_own()  # before wrapping: Dynamo's remap table keeps torch's functions
        for name in OPS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            if name in ("isend", "irecv"):
                wrapper = Peer(name, wrapper, original)
            self._wrapped[name] = (original, wrapper)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        if not self.log_only:
            wait = dist.Work.wait
            self._wait = (wait, self._wrap_wait(wait))
            dist.Work.wait = self._wait[1]

    def remove(self) -> None:
        """The originals back where nothing wrapped them since; a wrapper left in place passes calls through."""
        import torch.distributed as dist

        self.active = False
        self._handle.remove()
        if not self._wrapped:
            return
        c10d = dist.distributed_c10d
        for name, (original, wrapper) in self._wrapped.items():
            for where in (c10d, dist):
                if getattr(where, name, None) is wrapper:
                    setattr(where, name, original)
        self._wrapped = {}
        if self._wait is not None and dist.Work.wait is self._wait[1]:
            dist.Work.wait = self._wait[0]
        self._wait = None
        self._pending.clear()

    # -- the wrappers ---------------------------------------------------------------------------------
    def _wrap(self, name: str, original: Any) -> Any:
        me, inside = self, self._inside
        try:
            self._params[name] = tuple(inspect.signature(original).parameters)
        except (TypeError, ValueError):  # no signature: msprobe's order, positional then keyword
            self._params[name] = ()

        @functools.wraps(original)
        def obs_monitor_cc(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():  # traced by Dynamo: torch's own collective, the graph as without obs
                return original(*args, **kwargs)
            if not me.active or getattr(inside, "depth", 0):  # off, or called by another wrapped collective
                return original(*args, **kwargs)
            if name == "batch_isend_irecv":
                same_ops(args, kwargs)
            call = None
            try:
                call = me._before(name, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - reported; the collective runs as it would
                report_internal_error("monitor: collectives", exc)
            inside.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                inside.depth = 0
            if call is not None:
                try:
                    me._after(name, call, args, kwargs, result)
                except Exception as exc:  # noqa: BLE001 - reported; the collective's result is returned
                    report_internal_error("monitor: collectives", exc)
            return result

        return obs_monitor_cc

    def _wrap_wait(self, original: Any) -> Any:
        pending = self._pending

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(work, *args, **kwargs)
            if pending and not is_compiling():
                got = pending.pop(work, None)
                if got is not None:
                    try:
                        self._post(*got)
                    except Exception as exc:  # noqa: BLE001 - reported; the wait returns as it would
                        report_internal_error("monitor: collectives", exc)
            return out

        return wait

    def _before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The call's number within the step when it is recorded (its ``pre`` rows taken), else None."""
        collector = self.collector
        step = collector._step_now
        if not collector.plan.due(step):
            return None
        if self.log_only:  # every call site, as msprobe's cc_log_hook (cc_codeline does not filter it)
            if self.logged is not None:
                self._log(name, args, kwargs)
            return None
        if step != self._step:  # a new step: what an earlier one left (no optimizer step took it) goes
            with self._lock:
                self._step, self.rows, self.parts, self.calls = step, [], [], {}
            self._pending.clear()
        if self.codeline:
            stack = ";".join(call_stack())
            if not any(p.search(stack) for p in self.codeline):
                return None
        with self._lock:
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
        if name not in self.order:
            self.order[name] = None
            self._new_order = True
        if self.pre:
            self._record(name, call, "pre", tensor_args(self._params[name], args, kwargs), OUTPUT_ONLY.get(name))
        return call

    def _after(self, name: str, call: int, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        tensors = tensor_args(self._params[name], args, kwargs)
        if result is None:
            self._record(name, call, "post", tensors)
            return
        works = result if isinstance(result, list) else [result]  # batch_isend_irecv: its last work
        if works and hasattr(works[-1], "wait"):
            self._pending[works[-1]] = (name, call, tensors)
        else:
            self._record(name, call, "post", tensors)

    def _post(self, name: str, call: int, tensors: list[Any]) -> None:
        if self.active:
            self._record(name, call, "post", tensors)

    def _record(self, name: str, call: int, side: str, tensors: list[tuple[str, Any]],
                skip: set[str] | None = None) -> None:
        if not tensors:
            return
        with torch.no_grad(), suppressed():
            for i, (param, arg) in enumerate(tensors):
                if skip is not None and param in skip:
                    continue
                t, shape, dtype = described(arg)
                row, part = (f"{name}/{side}_{i}", call, shape, dtype), stats(t, self.ops, self.eps)
                with self._lock:  # a row and its values together: a collective may come from another thread
                    self.rows.append(row)
                    self.parts.append(part)

    def _log(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """msprobe's ``cc_log_only`` entry of a call: dtypes, the group's ranks and the stack, ``;``-joined."""
        import torch.distributed as dist

        assert self.logged is not None
        every = (*args, *kwargs.values())
        dtypes = "|".join(str(a.dtype) if isinstance(a, torch.Tensor) else "" for a in every)
        group = next((a for a in every if isinstance(a, dist.ProcessGroup)), None)
        try:
            ranks = "|".join(str(r) for r in dist.get_process_group_ranks(group or dist.GroupMember.WORLD))
        except Exception:  # noqa: BLE001 - no default group (yet): the call itself says so to the user
            ranks = ""
        self.logged.setdefault(name, {})[";".join([dtypes, ranks, *call_stack()])] = None

    # -- the step -----------------------------------------------------------------------------------------
    def __call__(self, opt: Any, step: int) -> tuple[Block, torch.Tensor] | None:
        """The collector's extra block of ``step``: the rows recorded since its start (None: none)."""
        if self.log_only or step != self._step or not self.rows:
            return None
        with self._lock:
            rows, parts = tuple(self.rows), self.parts
            self.rows, self.parts, self.calls = [], [], {}
        if self._new_order:  # monitor.json written again with the step's packet (the collector's, or ours)
            self._new_order = False
            self.collector.meta["collectives"] = list(self.order)
            self.collector._meta_sent = (-1, -1)
        self._pending.clear()  # a work not waited by now: no post rows
        self._step = -1
        rows = self._last_rows = same_rows(rows, self._last_rows)
        with torch.no_grad(), suppressed():  # one device's vector (a CPU part pinned first: no host wait)
            device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
            values = torch.cat([p if p.device == device else p.pin_memory().to(device, non_blocking=True)
                                if p.device.type == "cpu" else p.to(device) for p in parts])
        return Block(PREFIX, rows, self.ops), values

    def _post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        """After the optimizer step (and the collector's hook): the rows the collector did not take, as a packet of
        their own; with cc_log_only, the list of call sites once, at the end of the first step that called any."""
        try:
            if self.log_only:
                if self.logged:
                    self._write_log()
                return
            step = self._step
            if self.rows and step < self.collector._step_now:
                got = self(opt, step)
                if got is not None:
                    self.collector._send_meta()
                    self.collector.worker.submit(Packet(step, [got[0]], to_host([got[1]])))
        except Exception as exc:  # noqa: BLE001 - reported; the training loop goes on
            report_internal_error("monitor: collectives", exc)

    def _write_log(self) -> None:
        """msprobe's list of the collectives and their call sites, once (``expected_cc_log.json``'s layout)."""
        logged, self.logged = self.logged or {}, None
        body = {name: [entry.split(";") for entry in entries] for name, entries in sorted(logged.items())}
        where = ""
        if self.folder is not None:
            where = os.path.join(self.folder, LOG_FILE)
            safe_files.write_atomic(where, json.dumps(body, indent=1), fsync=False)
        logger.info("obs: monitor: cc_log_only: %d collective(s) at %d call site(s)%s", len(body),
                    sum(len(v) for v in body.values()), f", listed in {where}" if where else f": {json.dumps(body)}")

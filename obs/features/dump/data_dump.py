"""The data dump in eager PyTorch: selected steps × aten ops → MindSpore's layout, names and statistic.csv.

::

    {path}/rank_{r}/.dump_metadata/config.json, data_dump.json (the user's JSON, byte for byte)
    {path}/rank_{r}/{net_name}/0/{iteration}/{op_type}.{escaped full name}.0.0.{us}.{input|output}.{slot}.DefaultFormat.{Dtype}.npy
    {path}/rank_{r}/{net_name}/0/{iteration}/statistic.csv
    {path}/rank_{r}/execution_order/ms_execution_order_graph_0.csv, ms_global_execution_order_graph_0.csv

Ops come from the op dispatch mode (OP_OUTPUT); the tensors of Inductor-compiled graphs from the graphs
themselves (GRAPH_STATS: statistics only, one output row per node, after the step's other rows).  An op's full name is MindSpore-style: the module
scope, the op type in CamelCase and its index in the step (``Default/net-Net/fc1-Linear/Addmm-op3``);
ops run by autograd in backward are under ``Gradients/``.  Eager PyTorch has one graph: id 0.
Iteration N is the N-th step (from ``initial_iteration``).  Statistics are computed when the op
returns (later in-place writes cannot change them); a tensor the op itself writes in place is recorded as
its input as it was before the op (the op interceptor copies it in dumped steps) and statistic.csv is written at the step's end.
On CUDA nothing waits for the device: statistics are reduced
on it and read with the step's others after the step, and tensors are copied into pinned memory, their files
written off the training thread (:mod:`obs.features.dump.stats.device_stats`, :mod:`obs.features.dump.pinned_files`);
:meth:`DataDump.flush` waits for them.  Steps outside ``iteration`` cost one flag test per op.  Slots follow argument positions: a
non-tensor argument leaves a gap, as in MindSpore's dump.  The outputs of ops that return uninitialised
memory (``empty_like``: garbage that differs from run to run) are not dumped; the op that fills such a
tensor dumps it.  With ``dump_mode`` 0 and outputs dumped,
the root module's parameters are written as MindSpore's ``Parameter.{name}...output.0...``
files (and rows) when it is first called in a dumped step, before this step updates them.

A statistics-only dump consumes ops in C++ where ``obs/features/dump/stats/_fast_rows.cpp`` is built
(:mod:`obs.features.dump.stats.native_rows`): its ``on_op`` is :meth:`DataDump._on_op` without a Python frame per op,
and calls back here only for what is done once per op type or full name (:meth:`DataDump._new_kind`,
:meth:`DataDump._name_entry`) and for backward ops' modules.  Both write the same files.
"""  # noqa: E501 - the layout above names each file whole

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from obs._core import outputs, safe_files
from obs._core.demands import demands
from obs._core.events import Event, Subscription, bus
from obs._core.internal import SUPPRESSION, report_internal_error, suppressed
from obs._core.rank_folders import rank_folder
from obs.features.compiled_notice import INDUCTOR, CompiledNotice
from obs.features.dump._autograd_scopes import ModuleSpans
from obs.features.dump._file_names import escape_name, inside, op_type
from obs.features.dump._npy import npy_bytes
from obs.features.dump._tensors import UNINITIALISED_OPS, host_array, ms_dtype
from obs.features.dump.pinned_files import PinnedFiles
from obs.features.dump.stats.graph_rows import GraphRow, columns_for, filled, graph_rows
from obs.features.dump.stats.statistic_csv import Op, StatisticRows, each_tensor
from obs.runtime.steps import tracker
from obs.runtime.torch import set_inputs_before_writes
from obs.settings.dump_config import DumpConfig
from obs.settings.parallel import rank

if TYPE_CHECKING:
    from obs.runtime.torch import DeviceRows

__all__ = ["DataDump", "op_type"]

logger = logging.getLogger("obs")

GRAPH_ID = 0
ORDER_HEADER = "NodeExecutionOrder-FullNameWithScope"
_NOT_OPS = ("_record_function",)  # the optimizer's profiler annotations, not computations
current_node = torch._C._current_autograd_node
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _write_fresh(path: str, text: str) -> None:
    """``path`` created in place (in a folder made this step), or replaced whole when an earlier run left one."""
    try:
        safe_files.write_new(path, text.encode(), folder_ready=True)
    except FileExistsError:
        safe_files.write_atomic(path, text, fsync=False)


def _append(path: str, text: str) -> None:
    fd = safe_files.open_append(path, what="dump file")
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class DataDump:
    """Subscribes to steps and op outputs while on; writes one iteration folder per selected step."""

    def __init__(self, config: DumpConfig) -> None:
        self.config = config
        self._active = False
        self.iteration = -1
        self._ops = 0  # ops named in this step (the C++ consumer counts its own)
        self._order: list[str] = []  # cleared in place: the C++ consumer appends to this list
        self._dumped: list[int] = []
        self._folder = ""
        self._subs: list[Subscription] = []
        self._demand: Any = None
        self._types: dict[str, str] = {}
        self._names: dict[str, tuple[str, str, bool]] = {}
        self._last_stamp = 0
        self._rank = -1
        self._graph_dir = self._order_dir = ""
        self._graph_checked = self._folder_made = False
        self._tensors, self._statistics = config.tensors, config.statistics
        self.spans = ModuleSpans()
        self._inputs, self._outputs = config.input_output != 2, config.input_output != 1
        self.rows = StatisticRows(config.statistic_category, native=self._statistics and not self._tensors)
        self.files = PinnedFiles(self.rows.device.poller)  # CUDA tensors' files, written by the same thread
        # statistics only: the rows' recorder (C++ where built); with tensor files: each tensor through _tensor
        self._add = self._each if self._tensors else self.rows.add_values
        # Where the rows are recorded in C++, ops are consumed there too (on_op: this class's _on_op, without a
        # Python frame per op); what is done once per op type or full name stays here.
        # The module intervals that name backward ops, and the root's first call, are kept there too (enter, leave).
        self._native = self.rows.native
        if self._native is not None:
            self._native.name_ops(self._types, self._new_kind, self._names, self._name_entry, self._order,
                                  self._on_root, SUPPRESSION, UNINITIALISED_OPS, self._inputs, self._outputs)
        self._wants_parameters = config.dump_mode == 0 and config.input_output != 1
        self._lock = threading.Lock()
        self._metadata_written = False
        self._parameters_done = False
        self._parameter_names: dict[str, str] = {}  # parameter name → its escaped file name
        self._written_order: list[str] | None = []  # None: write the execution order again
        self._in_graph = False  # a compiled graph that computes its own statistics is running
        self._notice: CompiledNotice | None = None
        self._graph_root = "Default"  # the scope of the compiled module whose forward ran last
        self._classes: dict[str, str] | None = None  # the root module's submodules' classes, by qualified name
        self._classes_of = 0
        from obs.settings._context import get_context

        self._keep_class = bool(get_context("reserve_class_name_in_scope"))
        self._ended = 0  # steps that ended while installed
        self._recorded = 0  # ops of selected steps before the current one

    def install(self) -> DataDump:
        self._demand = tracker.require("data dump")
        self._subs = [bus.subscribe(Event.STEP_BEGIN, self._on_step_begin),
                      bus.subscribe(Event.STEP_END, self._on_step_end)]
        # The module subscribers also keep the module wrapper, whose scope stack names the ops.
        if self._native is not None:
            self._subs += [bus.subscribe(Event.OP_OUTPUT, self._native.on_op),
                           bus.subscribe(Event.MODULE_ENTER, self._native.enter),
                           bus.subscribe(Event.MODULE_EXIT, self._native.leave)]
        else:
            self.spans.install()
            self._subs.append(bus.subscribe(Event.OP_OUTPUT, self._on_op))
            if self._wants_parameters:
                self._subs.append(bus.subscribe(Event.MODULE_ENTER, self._on_module))
        if self._statistics:  # Inductor-compiled graphs compute their own tensors' statistics, of every node
            demands.graph_stats[self] = (columns_for(self.config.statistic_category), True)
            self._subs.append(bus.subscribe(Event.GRAPH_STATS, self._on_graph))
        if self._tensors:
            self._notice = CompiledNotice("the data dump", (
                "tensors inside Inductor-compiled graphs are not saved (they live inside fused kernels)"
                + ("; their statistics are in statistic.csv, one output row per node" if self._statistics else
                   "; saved_data 'full' also gives their statistics")
                + ". To save them, dump steps run without torch.compile, or compile with backend='aot_eager' "
                "(its ops run one by one)"), when=INDUCTOR)
        if tracker.in_step:  # turned on in the middle of a step: start with the next one
            self.active = False
        atexit.register(self._at_exit)
        return self

    @property
    def active(self) -> bool:
        """Whether ops are recorded now (a selected step is running)."""
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        if self._native is not None:
            self._native.active = value
        # an in-place op's rows: its input as before the op wrote it, its output as after (the op interceptor
        # copies both in dumped steps; the tensor's version is bumped only after the op, too late for the rows' cache)
        set_inputs_before_writes(value)

    @property
    def _count(self) -> int:
        return self._ops if self._native is None else self._native.count

    @_count.setter
    def _count(self, value: int) -> None:
        if self._native is None:
            self._ops = value
        else:
            self._native.count = value

    def remove(self) -> None:
        demands.graph_stats.pop(self, None)
        set_inputs_before_writes(False)
        for sub in self._subs:
            sub.remove()
        self._subs = []
        if self._notice is not None:
            self._notice.remove()
        self.spans.remove()
        if self._demand is not None:
            self._demand.remove()
            self._demand = None
        atexit.unregister(self._at_exit)
        if self.active:
            self._finish()
        self.files.send()
        self.rows.close()  # what the steps left for the device is written first

    def nothing_dumped(self) -> str | None:
        """Why this dump has written no iteration yet (None once one is written, or while no op has run)."""
        if self._dumped or not self.config.e2e.get("enable", True):  # dumped, or switched off on purpose
            return None
        iteration = self.config.iteration
        if not self._ended and (self._count or self._recorded):
            return (f"no training step ended, so the data dump wrote nothing to {self.config.path} "
                    f"({self._count + self._recorded} ops recorded in iteration {self.iteration}). A step ends when "
                    f"optimizer.step() returns; a loop that updates its weights another way marks its steps with "
                    f"'with obs.step():' or 'for batch in obs.steps(loader):'.")
        if self._ended:
            return (f"the data dump wrote nothing to {self.config.path}: its 'iteration' is {iteration!r}, "
                    f"and the run ended after iteration {self.iteration}.")
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (on this thread) until the files of the steps dumped so far are written; False when ``timeout``
        seconds passed first."""
        self.files.send()
        return self.rows.flush(timeout)

    def _at_exit(self) -> None:
        try:
            self.flush(10.0)
        except Exception as exc:  # noqa: BLE001 - reported; the interpreter is going away
            report_internal_error("data dump at exit", exc)
        reason = self.nothing_dumped()
        if reason is not None:
            logger.warning("obs: %s", reason)

    # -- folders ----------------------------------------------------------------------------------
    def rank_dir(self) -> str:
        return inside(self.config.path, rank_folder(rank()))

    def _write_metadata(self) -> None:
        meta = inside(self.rank_dir(), ".dump_metadata", escape=False)
        safe_files.ensure_dir(meta)
        device = "GPU" if torch.cuda.is_available() and torch.cuda.is_initialized() else "CPU"
        from obs._core.version import __version__

        safe_files.write_atomic(os.path.join(meta, "config.json"),
                                json.dumps({"device_target": device, "ms_version": f"obs {__version__}"}),
                                fsync=False)
        raw = self.config.raw or json.dumps({"common_dump_settings": {}}, indent=2)
        safe_files.write_atomic(os.path.join(meta, "data_dump.json"), raw, fsync=False)
        self._metadata_written = True

    # -- steps ------------------------------------------------------------------------------------
    def _on_step_begin(self, step: int) -> None:
        iteration = self.config.initial_iteration + step - 1
        self._recorded += self._count
        self.iteration, self._count = iteration, 0
        self._order.clear()
        self.rows.clear()
        self._parameters_done = False
        if self._native is not None:
            self._native.parameters_pending = self._wants_parameters
        self.active = iteration in self.config.iterations and bool(self.config.e2e.get("enable", True))
        if self.active:
            if not self._metadata_written:
                self._write_metadata()
            r = rank()
            if r != self._rank:  # the folders of this rank, checked once
                self._rank, rank_dir = r, self.rank_dir()
                self._graph_dir = inside(rank_dir, self.config.net_name, str(GRAPH_ID))
                self._graph_checked = False
                self._order_dir = inside(rank_dir, "execution_order", escape=False)
            self._folder = os.path.join(self._graph_dir, str(iteration))  # made with its first file
            self._folder_made = False

    def _on_module(self, scope: str, module: Any) -> None:
        """The root module's first call in a dumped step: its parameters, as MindSpore's Parameter files."""
        if not self.active or self._parameters_done or len(SUPPRESSION.stack) != 1:
            return
        self._parameters_done = True
        self._on_root(module)

    def _on_root(self, module: Any) -> None:
        escaped = self._parameter_names
        module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the module's own names
        if self._classes_of != id(module):  # a compiled graph's rows name containers as eager scopes do
            self._classes_of = id(module)
            self._classes = {q: type(m).__name__ for q, m in module.named_modules() if q}
        try:
            with suppressed():
                for name, tensor in module.named_parameters():
                    file_name = escaped.get(name)
                    if file_name is None:
                        file_name = escaped[name] = escape_name(name.replace(".", "_"))
                    self._add(self._op("Parameter", file_name), "output", (tensor,))
        except Exception as exc:  # noqa: BLE001 - reported; a dump bug must not break the training loop
            report_internal_error("data dump parameters", exc)

    def _on_step_end(self, step: int, duration_ns: int) -> None:
        self._ended += 1
        if self._in_graph:  # a compiled graph raised before its end
            self._in_graph, self.active = False, True
        if self.active:
            self._finish()

    def _finish(self) -> None:
        # A rename costs milliseconds on some file systems (overlay): new files are created in place, and the
        # execution order is rewritten only when it changed.
        self.active = False
        with suppressed():
            folder = self._made_folder()  # the iteration's folder, even when no tensor was selected
            self.files.send()
            if self._statistics:
                path = os.path.join(folder, "statistic.csv")
                self.rows.write_text(lambda text: _write_fresh(path, text))
            self._dumped.append(self.iteration)
            order = self._order_dir  # its files are created with their folder
            global_order = os.path.join(order, f"ms_global_execution_order_graph_{GRAPH_ID}.csv")
            fresh = len(self._dumped) == 1
            if not fresh:
                try:
                    _append(global_order, f"{self.iteration}\n")
                except FileNotFoundError:  # removed during the run: both files are written again, from here
                    fresh, self._written_order = True, None
            if fresh:
                safe_files.write_atomic(global_order, f"{self.iteration}\n", fsync=False)
            if self._order != self._written_order:
                safe_files.write_atomic(os.path.join(order, f"ms_execution_order_graph_{GRAPH_ID}.csv"),
                                        ORDER_HEADER + "\n" + "".join(f"{n}\n" for n in self._order), fsync=False)
                self._written_order = list(self._order)
        if len(self._dumped) == 1:  # obs run lists the folder of the iterations once, not each of them
            outputs.wrote("data dump", self._graph_dir)
        self._order.clear()
        self.rows.clear()

    def _made_folder(self) -> str:
        """This step's iteration folder, made on first use: the graph folder is walked and checked once
        (:func:`obs._core.safe_files.ensure_dir`, ~10 syscalls), each iteration folder is one ``mkdir`` in it."""
        if not self._folder_made:
            try:
                if not self._graph_checked:
                    safe_files.ensure_dir(self._graph_dir)
                    self._graph_checked = True
                os.mkdir(self._folder, safe_files.DIR_MODE)
            except OSError:  # left by an earlier run, or the folders were removed meanwhile: the full walk
                safe_files.ensure_dir(self._folder)
            self._folder_made = True
        return self._folder

    # -- ops --------------------------------------------------------------------------------------
    def _on_op(self, name: str, args: Any, kwargs: Any, output: Any) -> None:
        if not self._active:
            return
        kind = self._types.get(name)
        if kind is None:
            kind = self._new_kind(name)
        if not kind:
            return
        n = self._ops
        self._ops = n + 1
        node = current_node()
        if node is not None:  # run by autograd: named after the forward module that made the node
            scope = "Gradients/" + (self.spans.module_of(node) or "Default")
        else:
            stack = SUPPRESSION.stack
            scope = stack[-1] if stack else "Default"
        full = f"{scope}/{kind}-op{n}"
        entry = self._names.get(full) or self._name_entry(full)
        self._order.append(entry[0])  # one line per op in execution_order
        if not entry[2]:
            return
        op = self._op(kind, entry[1])
        try:
            with suppressed():
                if self._inputs:
                    self._add(op, "input", (*args, *kwargs.values()) if kwargs else args)
                if self._outputs and not name.startswith(UNINITIALISED_OPS):  # garbage until written: not dumped
                    self._add(op, "output", (output if isinstance(output, (list, tuple)) else (output,),))
        except Exception as exc:  # noqa: BLE001 - reported; a dump bug must not break the training loop
            report_internal_error("data dump op", exc)

    def _on_graph(self, spec: dict[str, Any], rows: list[list[float]] | DeviceRows | None) -> None:
        """A compiled graph with statistics starts (``rows`` None: the ops it still dispatches one by one are
        left to its rows) or ends, with one row per tensor (obs.runtime.torch._graph_taps): read, or still on the
        device (DeviceRows: read with the step's other device statistics, after the step)."""
        if rows is None:
            if self._active:
                self._in_graph, self.active = True, False
            if not spec.get("backward") and SUPPRESSION.stack:
                self._graph_root = SUPPRESSION.stack[-1]
            return
        if not self._in_graph:
            return
        self._in_graph, self.active = False, True
        read, later = (rows, None) if isinstance(rows, list) else (None, rows)
        categories = self.config.statistic_category
        try:
            made: list[tuple[Op, int, GraphRow]] = []  # the rows whose values are still on the device
            for i, row in enumerate(graph_rows(spec, read, self._graph_root,
                                               self._keep_class, self._classes)):
                name = row.op.removeprefix("aten.")
                kind = self._types.get(name)
                if kind is None:
                    kind = self._new_kind(name)
                n = self._count
                self._count = n + 1
                full = f"{row.scope}/{kind}-op{n}"
                entry = self._names.get(full) or self._name_entry(full)
                self._order.append(entry[0])
                if entry[2] and self._outputs:
                    if later is not None:
                        made.append((self._op(kind, entry[1]), i, row))
                    else:
                        self.rows.add_computed(self._op(kind, entry[1]), "output", 0, row.statistics(categories),
                                               row.dtype, row.shape)
            if later is not None and made:
                columns = spec.get("columns", ())
                records = self.rows.device.record_rows(later.values, later.width, [
                    (i, row.dtype, row.shape, functools.partial(filled, row, columns, categories))
                    for _, i, row in made])
                for (op, _, _), record in zip(made, records):  # their text comes with their values
                    self.rows.add_computed_later(op, "output", 0, record)
        except Exception as exc:  # noqa: BLE001 - reported; a dump bug must not break the training loop
            report_internal_error("data dump of a compiled graph", exc)

    def _new_kind(self, name: str) -> str:
        """The op type of an aten op's name as file names write it, cached; "" for what is not a computation."""
        kind = self._types[name] = "" if name.startswith(_NOT_OPS) else escape_name(op_type(name), limit=48)
        return kind

    def _each(self, op: Op, io: str, values: Any) -> None:
        each_tensor(op, io, values, self._tensor)

    def _op(self, kind: str, name: str) -> Op:
        """``(op type, escaped name, µs)`` of an op: the microseconds of its file names and rows are one per op
        (its tensors share them) and increasing, so that readers order tensors as they were written."""
        if self._native is not None:  # one sequence with the C++ consumer's stamps
            return kind, name, self._native.stamp()
        now = time.time_ns() // 1000
        self._last_stamp = now = now if now > self._last_stamp else self._last_stamp + 1
        return kind, name, now

    def _name_entry(self, full: str) -> tuple[str, str, bool]:
        """An op's execution_order line, escaped file name and whether it is dumped: once per full name."""
        if len(self._names) > 1 << 16:
            self._names.clear()
        entry = self._names[full] = (_CONTROL.sub("_", full), escape_name(full), self.config.wants(full))
        return entry

    def _tensor(self, op: Op, io: str, slot: int, tensor: torch.Tensor) -> None:
        if self._tensors and tensor.layout is torch.strided and not tensor.is_meta and not tensor.is_nested:
            kind, name, stamp = op
            path = os.path.join(self._made_folder(), f"{kind}.{name}.0.0.{stamp}.{io}.{slot}.DefaultFormat."
                                                     f"{ms_dtype(tensor)}.npy")
            if self.files.takes(tensor):
                self.files.add(path, tensor)  # no read-back now: written once the device has copied it
            else:
                header, data = npy_bytes(host_array(tensor))
                safe_files.write_new(path, header, data, folder_ready=True)
        if self._statistics:
            self.rows.add(op, io, slot, tensor)

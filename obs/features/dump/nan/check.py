"""The NaN/Inf check: the first module (or op) whose output, or whose gradient in backward, is not finite.

Module granularity (the default): a global forward hook checks each module's tensor outputs (the
same tensor returned by nested modules is checked once; the output of a module that cannot make a
non-finite value from finite inputs, such as ReLU or MaxPool, is not read again when every input was
found finite in this step), and, when ``backward`` is on, puts a
gradient hook on the first output that requires grad, so the gradient reaching that module in
backward is checked too (except where such a module's backward makes it from a gradient already
checked: :mod:`obs.features.dump.nan._grad_links`).  Op granularity: every aten op's outputs (OP_OUTPUT), forward and
backward.
Each check is one sum (:func:`obs.features.dump.stats.tensor_stats.nonfinite_counts`); exact counts only when it fails.

On a finding (the first of a step, up to ``limit`` in all): a FAULT event ``nan_inf`` (recorded by
the RDR), a fault folder ``{root}/rank_{r}/nan_check/{stamp}_{scope}/`` with the inputs and the
non-finite outputs (or the gradient) and their counts, then either training goes on
(``action="continue"``) or a ``FloatingPointError`` is raised from the hook (``"raise"``), which
reaches the user as any error of that module would (and exception_dump dumps it when armed).

On CUDA no check waits for the device (``sync=False``, the default): each tensor's gate is taken on the device
and read with the step's others once the step has ended, off the training thread
(:mod:`obs.features.dump.nan.device_flags`); the first bad place of the step is found from them, and reported without
the tensors or exact counts (:mod:`obs.features.dump.nan.findings`, where ``action="raise"`` is raised later).
Inductor-compiled graphs' NaN/Inf counts stay on the device too, walked in their place with the step's gates
(with their exact counts).
``sync=True`` checks CUDA tensors as CPU ones are: a host sync per check, exact counts and the inputs.
"""

from __future__ import annotations

import atexit
import functools
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from obs._core.demands import demands
from obs._core.events import Event, Subscription, bus
from obs._core.internal import SUPPRESSION, report_internal_error
from obs.features.compiled_notice import CompiledNotice
from obs.features.dump._file_names import op_type
from obs.features.dump._tensors import UNINITIALISED_OPS, keep_scopes, tensors_in
from obs.features.dump.fault_folder import outputs_in
from obs.features.dump.nan import native_check
from obs.features.dump.nan._grad_links import ELEMENTWISE_BACKWARD, MAX_POOLS, GradLinks, preserves_in_backward
from obs.features.dump.nan.device_flags import DeviceFlags
from obs.features.dump.nan.findings import Findings, NonFiniteError
from obs.features.dump.stats.graph_rows import NONFINITE, GraphRow, graph_rows
from obs.features.dump.stats.tensor_stats import nonfinite_counts
from obs.runtime.steps import tracker
from obs.runtime.torch import AutogradCall, hidden_from_dynamo, skip_frames

if TYPE_CHECKING:
    from obs.runtime.torch import DeviceRows

__all__ = ["NanCheck", "NonFiniteError"]


#: Modules whose output is finite whenever every input is: bounded or selecting maps of their input, with no
#: parameter or factor that could overflow.  Matched by exact type (a subclass may override forward).  An input
#: counts as checked while its memory, size and version are those of a tensor found finite this step; a write
#: through ``.data`` does not move the version, and is not seen (as it is not by autograd).
FINITE_PRESERVING = frozenset({
    torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardtanh, torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.Identity,
    torch.nn.Flatten, torch.nn.Unflatten, torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.MaxPool3d,
    torch.nn.AdaptiveMaxPool1d, torch.nn.AdaptiveMaxPool2d, torch.nn.AdaptiveMaxPool3d})
_KNOWN_MAX = 4096  # tensors known finite in one step, at most


def _outputs_of(value: Any) -> Any:
    """:func:`~obs.features.dump.fault_folder.outputs_in`, without the generator for the common case: one tensor."""
    return (("output", value),) if isinstance(value, torch.Tensor) else outputs_in(value)


def _phase(spec: dict[str, Any]) -> str:
    return "backward" if spec.get("backward") else "forward"


class _QuietCompiledHookWarning:
    """While installed, torch's warning that a global module hook also fires for a ``torch.compile(module)``
    wrapper is not shown: that hook is obs's, and checking the wrapper's output is what obs wants."""

    _MESSAGE = r"Using `torch\.compile\(module\)` when there are global hooks on modules"

    def __init__(self) -> None:
        warnings.filterwarnings("ignore", message=self._MESSAGE, category=UserWarning)
        self._entry = warnings.filters[0]

    def remove(self) -> None:
        try:
            warnings.filters.remove(self._entry)  # type: ignore[arg-type]
        except ValueError:
            pass  # warnings.resetwarnings() or catch_warnings() already dropped it
        warnings._filters_mutated()  # type: ignore[attr-defined]


class NanCheck:
    """Finds the first non-finite module output / gradient (or op output) and reports it."""

    def __init__(self, root: str, *, action: str = "continue", granularity: str = "module", backward: bool = True,
                 limit: int = 1, sync: bool = False) -> None:
        self.root, self.action, self.granularity, self.backward = root, action, granularity, backward
        # limit: findings reported in all (0: one per step, without end)
        self._findings = Findings(root, action, limit, self._reported)
        self.findings = self._findings.findings
        # CUDA tensors' gates, read once per step off the training thread (None: sync, each read where it is made)
        self.flags = None if sync else DeviceFlags(self._findings.report_later)
        self._last_checked: Any = None
        self._finite: dict[tuple[int, int, int], Any] = {}  # (address, numel, version) → weakref, this step
        self._finite_step = -1
        self._links = GradLinks()
        self._native: Any = None  # the C++ module hook (native_check), where it is built
        self._outputs_read = self._gradients_read = 0  # in Python; see outputs_read, gradients_read
        self._handles: list[Any] = []  # removable handles and autograd wrappers
        self._subs: list[Subscription] = []
        self._demand: Any = None
        self._graph_root = "Default"  # the scope of the compiled module whose forward graph ran last
        from obs.settings._context import get_context

        self._keep_class = bool(get_context("reserve_class_name_in_scope"))  # as the module wrapper's scopes

    def install(self) -> NanCheck:
        self._demand = tracker.require("NaN/Inf check")  # findings name their step; one report per step
        # The module wrapper (installed for this subscriber) gives the scope names findings report.
        self._subs.append(bus.subscribe(Event.MODULE_ENTER, keep_scopes))
        # Inductor-compiled graphs count their own tensors' NaN/Inf: the first node that made one is named.
        demands.graph_stats[self] = (frozenset(NONFINITE), self.granularity == "op")  # module: module outputs
        self._subs.append(bus.subscribe(Event.GRAPH_STATS, self._on_graph))
        if self.flags is not None:
            self._subs.append(bus.subscribe(Event.STEP_END, self._on_step_end))
            atexit.register(self._at_exit)
        if self.granularity == "module":
            self._handles.append(CompiledNotice("the NaN/Inf check", (
                "the modules inside a compiled module are not checked one by one: an Inductor-compiled graph names "
                "the first node whose output holds NaN/Inf; with other backends the compiled module's output and "
                "gradient are checked, and granularity 'op' checks each op they run")))
        if self.granularity == "op":
            self._subs.append(bus.subscribe(Event.OP_OUTPUT, self._on_op))
        else:
            self._native = native_check.module_check(
                suppression=SUPPRESSION, tracker=tracker, preserving=FINITE_PRESERVING,
                elementwise=ELEMENTWISE_BACKWARD, pools=frozenset(MAX_POOLS), pool_preserves=preserves_in_backward,
                slow=self._on_module, report=self._report_output, grad_report=self._check_gradient,
                backward=self.backward)
            # Compiled graphs leave the hook out; the compiled module's own output is still checked, eagerly.
            hook = hidden_from_dynamo(self._on_module if self._native is None else self._native.on_module)
            for slow_path in (self._on_module, self._report_output, self._check_gradient):
                skip_frames(slow_path.__code__, recursive=True)  # run by the C++ hook inside compiled calls
            self._handles.append(torch.nn.modules.module.register_module_forward_hook(hook))
            self._handles.append(_QuietCompiledHookWarning())
            if self.backward:
                settle = self._settle if self._native is None else self._native.settle
                self._handles += [AutogradCall(torch.autograd, "backward", on_start=settle),
                                  AutogradCall(torch.autograd, "grad", on_start=settle)]
        return self

    def remove(self) -> None:
        demands.graph_stats.pop(self, None)
        if self._native is not None:
            self._native.disable()  # gradient hooks still to run stay inert
        if self._demand is not None:
            self._demand.remove()
            self._demand = None
        for handle in self._handles:
            if isinstance(handle, AutogradCall):
                handle.unwrap()
            else:
                handle.remove()
        for sub in self._subs:
            sub.remove()
        self._handles, self._subs = [], []
        if self.flags is not None:
            atexit.unregister(self._at_exit)
            self.flags.close()  # the steps in flight are still reported

    @property
    def done(self) -> bool:
        return self._findings.done

    @property
    def limit(self) -> int:
        return self._findings.limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._findings.limit = value

    @property
    def _step_reported(self) -> int:
        return self._findings.step_reported

    def flush(self, timeout: float | None = None) -> bool:
        """Report what the device gates of the steps so far hold, waiting for them (on this thread); False when
        ``timeout`` seconds passed first."""
        return True if self.flags is None else self.flags.flush(timeout)

    def _at_exit(self) -> None:
        try:
            self.flush(10.0)
        except Exception as exc:  # noqa: BLE001 - reported; the interpreter is going away
            report_internal_error("NaN/Inf check at exit", exc)

    def _on_step_end(self, step: int, duration_ns: int) -> None:
        flags = self.flags
        if flags is not None and flags.pending:
            flags.end_step()

    def _reported(self, step: int, late: bool) -> None:
        """A finding of ``step`` was made (under the findings' lock)."""
        if self._native is not None:
            self._native.reported_step = step
            # a late finding's raise comes from the next Python check: the C++ hook must still call it
            if self.done and not (late and self.action == "raise"):
                self._native.disable()

    def _raise_pending(self) -> None:
        """Raise a late finding's error (action "raise") here, on the training thread."""
        if self.done and self._native is not None:
            self._native.disable()
        self._findings.raise_pending()

    @property
    def outputs_read(self) -> int:
        """Module outputs read so far (module granularity): what the finite-preserving modules save shows here."""
        return self._outputs_read + (self._native.outputs_read if self._native is not None else 0)

    @property
    def gradients_read(self) -> int:
        """Gradients read so far (in backward, module granularity): what the gradient links save shows here."""
        return self._gradients_read + (self._native.gradients_read if self._native is not None else 0)

    # -- hooks ----------------------------------------------------------------------------------
    def _on_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if SUPPRESSION.depth:
            return
        if self._findings.pending is not None:  # a late finding of action "raise": raised here, on this thread
            self._raise_pending()
        if self.done or self._step_reported == tracker.step:
            return
        stack = SUPPRESSION.stack
        scope = stack[-1] if stack else type(module).__name__
        if self._finite_step != tracker.step:
            self._finite.clear()
            self._links.new_step()
            self._finite_step = tracker.step
        derived = type(module) in FINITE_PRESERVING and self._all_finite(args)
        watched = None
        for where, tensor in _outputs_of(output):
            # A container's output, a flatten: the same elements are checked once.  The last tensor checked must
            # still be alive, or its memory could hold another tensor at the same address.
            key = (tensor.data_ptr(), tensor.numel(), tensor._version)
            last = self._last_checked
            if last is not None and last[1] == key and last[0]() is not None:
                continue
            self._last_checked = (weakref.ref(tensor), key)
            if not derived:
                self._outputs_read += 1
                flags = self.flags
                if flags is not None and flags.takes(tensor):  # gated on its device, read after the step
                    flags.check(tensor, tracker.step, ("forward", "module", scope, type(module).__name__, where))
                    counts = None
                else:
                    counts = nonfinite_counts(tensor)
                if counts is not None:
                    self._found("forward", "module", scope, type(module).__name__, counts, where,
                                [("inputs", list(tensors_in(args))), ("outputs", [(where, tensor)])])
                    return
            if len(self._finite) < _KNOWN_MAX:
                self._finite[key] = weakref.ref(tensor)
            if watched is None and self.backward and tensor.requires_grad:
                watched = tensor
        if watched is not None:
            watch = self._links.watch(watched, self._grad_hook(scope, type(module).__name__))
            if preserves_in_backward(module):
                self._links.cover(args, watched, watch)

    def _all_finite(self, args: Any) -> bool:
        """Whether every tensor of ``args`` was found finite in this step and is unchanged since (same memory,
        size and version, still alive)."""
        found = False
        for _, tensor in _outputs_of(args[0]) if len(args) == 1 else tensors_in(args):
            ref = self._finite.get((tensor.data_ptr(), tensor.numel(), tensor._version))
            if ref is None or ref() is None:
                return False
            found = True
        return found

    def _settle(self, roots: Any) -> None:
        if not self.done:
            self._links.settle(roots)

    def _grad_hook(self, scope: str, op: str) -> Any:
        def check(grad: Any) -> None:
            try:
                self._check_gradient(scope, op, grad)
            except NonFiniteError:
                raise  # action "raise": the user asked for it
            except Exception as exc:  # noqa: BLE001 - reported; a bug of ours must not break the backward pass
                report_internal_error("NaN/Inf check of a gradient", exc)

        return check

    def _check_gradient(self, scope: str, op: str, grad: torch.Tensor | None) -> None:
        """The gradient reaching ``scope``'s output (the native hooks call this when their gate fails); None where
        autograd hands none (an output no loss depends on, as a compiled graph's backward reports it)."""
        if grad is None:
            return
        if self._findings.pending is not None:
            self._raise_pending()
        if self.done or self._step_reported == tracker.step:
            return
        self._gradients_read += 1
        flags = self.flags
        if flags is not None and flags.takes(grad):
            flags.check(grad, tracker.step, ("backward", "module", scope, op, "gradient of the output"))
            return
        counts = nonfinite_counts(grad)
        if counts is not None:
            self._found("backward", "module", scope, op, counts, "gradient of the output",
                        [("gradients", [("grad_output", grad)])])

    def _report_output(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        """The native hook found ``output`` (one tensor) not finite."""
        counts = nonfinite_counts(output)
        if counts is not None:
            stack = SUPPRESSION.stack
            self._found("forward", "module", stack[-1] if stack else type(module).__name__, type(module).__name__,
                        counts, "output", [("inputs", list(tensors_in(args))), ("outputs", [("output", output)])])

    def _on_op(self, name: str, args: Any, kwargs: Any, output: Any) -> None:
        if self._findings.pending is not None:
            self._raise_pending()
        if self.done or self._step_reported == tracker.step or name.startswith(UNINITIALISED_OPS):
            return
        flags = self.flags
        for where, tensor in outputs_in(output):
            if flags is not None and flags.takes(tensor):
                flags.check(tensor, tracker.step, (self._op_phase(), "op", self._op_scope(), name, where))
                continue
            counts = nonfinite_counts(tensor)
            if counts is not None:
                self._found(self._op_phase(), "op", self._op_scope(), name, counts, where,
                            [("inputs", list(tensors_in(args, kwargs))), ("outputs", [(where, tensor)])])
                return

    @staticmethod
    def _op_phase() -> str:
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    @staticmethod
    def _op_scope() -> str:
        stack = SUPPRESSION.stack
        return stack[-1] if stack else ""

    def _on_graph(self, spec: dict[str, Any], rows: list[list[float]] | DeviceRows | None) -> None:
        """A compiled graph starts (``rows`` None) or ends with its statistics: read (the first row with NaN/Inf is
        reported now), or still on the device (DeviceRows: walked with the step's gates, after the step)."""
        if rows is None:
            if not spec.get("backward") and SUPPRESSION.stack:
                self._graph_root = SUPPRESSION.stack[-1]
            return
        if self.done or self._step_reported == tracker.step or (spec.get("backward") and not self.backward):
            return
        if not isinstance(rows, list):
            if self.flags is not None:
                self.flags.check_values(rows.values, tracker.step,
                                        functools.partial(self._walk_graph, spec, rows, self._graph_root))
                return
            rows = rows.read()  # sync: checked where the graph ran
        row = self._first_bad(spec, rows, self._graph_root)
        if row is not None:
            self._found(_phase(spec), "op", row.scope, op_type(row.op.removeprefix("aten.")), row.nonfinite,
                        "output", [])

    def _first_bad(self, spec: dict[str, Any], rows: list[list[float]], root: str) -> GraphRow | None:
        return next((row for row in graph_rows(spec, rows, root, self._keep_class) if any(row.nonfinite)), None)

    def _walk_graph(self, spec: dict[str, Any], rows: DeviceRows, root: str, step: int, values: list[float]) -> bool:
        """A compiled graph's rows read back after ``step`` (on the poller's thread): its first row with NaN/Inf is
        the finding, as :meth:`_on_graph` makes it (with its counts), unless one came first."""
        row = self._first_bad(spec, rows.split(values), root)
        if row is None:
            return not self.done
        return self._findings.report_counted_later(step, _phase(spec), "op", row.scope,
                                                   op_type(row.op.removeprefix("aten.")), row.nonfinite, "output")

    # -- reporting ------------------------------------------------------------------------------
    def _found(self, phase: str, kind: str, scope: str, op: str, counts: tuple[int, int, int], where: str,
               groups: list[tuple[str, Any]]) -> None:
        self._findings.report(tracker.step, phase, kind, scope, op, counts, where, groups, sys._getframe(2))

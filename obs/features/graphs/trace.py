"""The eager (PYNATIVE) trace graph: the aten ops of the first training step, with their module scopes.

A :class:`Tracer` is armed by the graphs feature at ``save_graphs`` >= 1 in PYNATIVE mode.  It asks for
step and module events (so scopes are tracked), pushes a dispatch mode when the first step begins
and pops it when that step ends, or when the root module is called again first (a loop without
``optimizer.step()``, or gradient accumulation: one forward and backward is traced); then it
unsubscribes, so the adapter removes its hooks and later steps cost nothing.  Forward ops get the scope of the module
they ran under (``Default/net-Net/fc1-Linear/addmm-op0``); backward ops that of the forward op they differentiate,
under ``Gradients/`` (matched by autograd's sequence numbers).
"""

from __future__ import annotations

import linecache
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from obs._core.events import Event, Subscription, bus
from obs._core.internal import SUPPRESSION, report_internal_error, suppressed
from obs.features.graphs.describe import abstract_of, literal
from obs.features.graphs.ir_text import _LIBRARY
from obs.features.graphs.model import Abstract, Graph, IrFile, Node, Param

__all__ = ["MAX_TRACE_NODES", "Tracer"]

#: ops recorded at most; a step with more is cut there (the graph says so in its attrs)
MAX_TRACE_NODES = 200_000
_FRAMES_KEPT = 12
_seq_nr = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node


def _frames() -> list[str]:
    """``path:line/source/`` of the user's frames on the stack (outside torch, obs, the standard library)."""
    out = []
    frame = sys._getframe(3)
    while frame is not None and len(out) < _FRAMES_KEPT:
        path = frame.f_code.co_filename
        if not path.startswith(_LIBRARY) and not path.startswith("<"):
            source = linecache.getline(path, frame.f_lineno).strip()
            out.append(f"{path}:{frame.f_lineno}/{source}/")
        frame = frame.f_back
    out.reverse()
    return out


class _Recording:
    """The graph being built: producers of live tensors, parameters met, nodes."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(parameter or buffer) -> qualified name
        self.graph = Graph("trace")
        self.producer: dict[int, tuple[str, Any]] = {}  # id(tensor) -> (ref, weakref)
        self.counters: dict[str, int] = {}
        self.forward_scope: dict[int, str] = {}  # autograd sequence number -> forward scope
        self.truncated = False
        self.inputs = 0

    def ref(self, t: torch.Tensor) -> str:
        found = self.producer.get(id(t))
        if found is not None and found[1]() is t:
            return found[0]
        self.inputs += id(t) not in self.names
        name = self.names.get(id(t)) or f"input{self.inputs}"
        a = abstract_of(t)
        weight = id(t) in self.names
        if weight:
            a = Abstract("Ref", a.dtype, a.shape, (f"ref_key={name}",) +
                         (("is_parameter",) if isinstance(t, torch.nn.Parameter) else ()) + a.extras)
        param = Param(len(self.graph.params) + 1, name, a, has_default=weight)
        self.graph.params.append(param)
        self._remember(t, param.ref)
        return param.ref

    def _remember(self, t: torch.Tensor, ref: str) -> None:
        try:
            self.producer[id(t)] = (ref, weakref.ref(t))
        except TypeError:
            pass

    def add(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, seq_before: int) -> None:
        if func.namespace == "profiler":  # record_function markers (the optimizer's), not computation
            return
        if len(self.graph.nodes) >= MAX_TRACE_NODES:
            self.truncated = True
            return
        op = str(func).removesuffix(".default")
        short = op.split(".")[1] if op.startswith("aten.") else op.rsplit(".", 1)[-1]
        k = self.counters.get(short, 0)
        self.counters[short] = k + 1
        node = _current_node()
        if node is not None:
            forward = self.forward_scope.get(node._sequence_nr(), f"Default/{node.name().rsplit('::', 1)[-1]}")
            scope = f"Gradients/{forward}/{short}-op{k}"
        else:
            stack = SUPPRESSION.stack
            forward = stack[-1] if stack else "Default"
            scope = f"{forward}/{short}-op{k}"
            # Autograd numbers the node of an op before dispatching it: the first op to see a number is the
            # one whose node took the number before it; that node's backward ops get this scope.
            self.forward_scope.setdefault(seq_before - 1, forward)
        refs = {}
        flat, _ = tree_flatten((args, kwargs))
        for item in flat:
            if isinstance(item, torch.Tensor):
                refs[id(item)] = self.ref(item)
        index = len(self.graph.nodes)
        rendered = [_render(a, refs) for a in args]
        attrs = {str(k): _render(v, refs) for k, v in kwargs.items()}
        inputs = [abstract_of(a) if not isinstance(a, (list, tuple)) or not any(isinstance(x, torch.Tensor) for x in a)
                  else Abstract("Tuple", elements=tuple(abstract_of(x) for x in a)) for a in args]
        self.graph.nodes.append(Node(index, f"{short}_{k}", op, rendered, attrs, inputs, [abstract_of(out)], scope,
                                     _frames()))
        outs, _ = tree_flatten(out)
        for t in outs:
            if isinstance(t, torch.Tensor):
                self._remember(t, f"%{index}")


def _render(value: Any, refs: dict[int, str]) -> str:
    if isinstance(value, torch.Tensor):
        return refs.get(id(value), "%?")
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_render(v, refs) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return literal(value, {})


class _TraceMode(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile compiles as without obs; compiled graphs are dumped from the compiler

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording
        self.active = True  # False once disarmed from another thread: the mode stays pushed but records nothing

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        seq = _seq_nr()
        out = func(*args, **kwargs)
        if SUPPRESSION.depth or not self.active:
            return out
        with suppressed():
            try:
                self.recording.add(func, args, kwargs, out, seq)
            except Exception as exc:  # noqa: BLE001 - reported; tracing must not break the step
                report_internal_error("save_graphs trace", exc)
        return out


class Tracer:
    """Armed until the first training step ends; ``done(doc)`` receives that step's trace graph."""

    def __init__(self, done: Callable[[IrFile], None]) -> None:
        self._done = done
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}
        self._root = ""
        self._mode: _TraceMode | None = None
        self._thread = 0
        self._step = 0
        self._traced_root: Any = None  # weak reference to the first top-level module called in the traced step
        self._subs: list[Subscription] = [
            bus.subscribe(Event.MODULE_ENTER, self._on_module),
            bus.subscribe(Event.STEP_BEGIN, self._on_begin),
            bus.subscribe(Event.STEP_END, self._on_end),
        ]

    def _on_module(self, scope: str, module: Any) -> None:
        if scope.count("/") != 1:
            return
        if self._mode is not None and threading.get_ident() == self._thread:
            if self._traced_root is None:
                self._traced_root = weakref.ref(module)  # the model whose forward the trace began in
            elif self._traced_root() is module:  # its next forward: the traced one is complete (no step end came)
                self._finish()
                return
        if self._root:
            return
        self._root = type(getattr(module, "_orig_mod", module)).__name__  # torch.compile's wrapper: what it wraps
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            self._names.setdefault(id(t), name)

    def _on_begin(self, step: int) -> None:
        with self._lock:
            if self._mode is not None or not self._subs:
                return
            self._mode = _TraceMode(_Recording(self._names))
            self._thread, self._step = threading.get_ident(), step
        self._mode.__enter__()

    def _on_end(self, step: int, duration_ns: int) -> None:
        if self._mode is not None and threading.get_ident() == self._thread:
            self._finish()

    def _finish(self) -> None:
        mode = self._mode
        if mode is None:
            return
        self.disarm()
        recording = mode.recording
        graph = recording.graph
        graph.name = f"{self._root or 'trace'}_step{self._step}"
        graph.attrs = {"stage": "trace", "step": str(self._step)}
        if recording.truncated:
            graph.attrs["truncated_at"] = str(MAX_TRACE_NODES)
        graph.return_scope = "Default/Return-op0"
        doc = IrFile(graph.name, [graph], {"stage": "trace", "step": str(self._step), "mode": "PYNATIVE"})
        self._done(doc)

    @property
    def armed(self) -> bool:
        """Still waiting for (or tracing) its step: subscribed, and not disarmed."""
        return any(sub.active for sub in self._subs)

    def disarm(self) -> None:
        """Stop: pop the dispatch mode (on the thread that pushed it) and drop every subscription."""
        with self._lock:
            subs, self._subs = self._subs, []
            mode, self._mode = self._mode, None
        if mode is not None:
            mode.active = False
            if threading.get_ident() == self._thread:
                mode.__exit__(None, None, None)
        for sub in subs:
            sub.remove()

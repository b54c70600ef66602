"""exception_dump: the inputs (and outputs) of the op or module that raised, saved where the failure happened.

Armed by ``ascend_config={"exception_dump": "1"|"2"}`` or the env config's ``exception_dump``
section.  Nothing is prepared per call: the module wrapper and the op dispatch mode call
:meth:`ExceptionDump.on_failure` only when an exception passes through them, innermost first, with
the failing call's own arguments (the stack of calls in flight *is* Python's stack).  So:

* module granularity (the default): the innermost module whose forward did not return, with what its
  ``forward`` received: where forward pre-hooks changed the call's arguments, those PyTorch's
  ``Module._call_impl`` handed on, read from its frame in the traceback (never by running the hooks
  again: they may be stateful or collective, as FSDP's all-gathers are);
* op granularity, whenever op interception is on for another feature (RDR ``op``, data dump):
  the aten op that raised, inside its module's scope;
* backward: ``torch.autograd.backward`` / ``grad`` are wrapped; a failure names the autograd node
  that raised (a custom Function's ``ctx``, or the node a message names), the forward module that
  created it (module calls record autograd sequence numbers at enter and exit), and dumps what
  autograd still holds: the gradients handed to the node and its saved tensors.

The dump is written before the FAULT event, so the RDR bundle of the same fault names it
(``fault.exception_dump``).  The exception itself is never touched beyond one attribute
(``_obs_exception_dump``, the folder) and always propagates unchanged.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from obs._core.internal import SUPPRESSION, report_internal_error, suppressed
from obs.features.compiled_notice import CompiledNotice
from obs.features.dump._autograd_scopes import ModuleSpans
from obs.features.dump._tensors import tensors_in
from obs.features.dump.fault_folder import outputs_in, python_stack, write_fault_folder
from obs.runtime.steps import tracker
from obs.runtime.torch import AutogradCall, failure_hooks
from obs.settings.parallel import rank

__all__ = ["ExceptionDump", "dump_of"]

MODES = {"1": "inputs and outputs", "2": "inputs only"}
#: What a failing module's ``inputs`` are (its meta.json's ``inputs_are``).
INPUTS_ARE = {"forward": "what forward received",
              "pre_hook": "what the forward pre-hook that raised was handed (forward was not called)",
              "call": "the module call's arguments: forward pre-hooks ran, but PyTorch's Module._call_impl frame "
                      "was not in the traceback, so what they handed forward is unknown"}
_NODE_IN_MESSAGE = re.compile(r"Function '?(\w+)'? returned")


def dump_of(error: BaseException) -> str | None:
    """The exception dump folder written for ``error``, if any."""
    return getattr(error, "_obs_exception_dump", None)


class ExceptionDump:
    """Writes one fault folder per failing exception under ``{root}/rank_{r}/exception_dump/``."""

    def __init__(self, mode: str, root: str) -> None:
        if mode not in MODES:
            raise ValueError(f"exception_dump mode must be one of {sorted(MODES)} (got {mode!r})")
        self.mode, self.root = mode, root
        self.written: list[str] = []
        self.spans = ModuleSpans()
        self._backward: Any = None
        self._grad: Any = None
        self._demand: Any = None
        self._notice: Any = None
        self._lock = threading.Lock()

    # -- install / remove ---------------------------------------------------------------------
    def install(self) -> ExceptionDump:
        # The module wrapper (installed for these subscribers) is what reports failing modules with their arguments.
        self.spans.install()
        self._demand = tracker.require("exception_dump")  # a dump names its training step
        failure_hooks.add(self.on_failure)
        self._notice = CompiledNotice("exception_dump", (
            "an error inside a compiled module is dumped at that module, with the inputs it was called with; "
            "PyTorch's error names the failing op (TORCHDYNAMO_VERBOSE=1 shows its graph)"))
        self._backward = AutogradCall(torch.autograd, "backward", on_error=self._on_backward_error)
        self._grad = AutogradCall(torch.autograd, "grad", on_error=self._on_backward_error)
        return self

    def remove(self) -> None:
        self.spans.remove()
        if self._demand is not None:
            self._demand.remove()
            self._demand = None
        if self._notice is not None:
            self._notice.remove()
            self._notice = None
        failure_hooks.remove(self.on_failure)
        for wrapper in (self._backward, self._grad):
            if wrapper is not None:
                wrapper.unwrap()
        self._backward = self._grad = None

    # -- forward failures ---------------------------------------------------------------------
    def on_failure(self, error: BaseException, kind: str, name: str, args: Any, kwargs: Any,
                   module: Any = None) -> None:
        """An aten op (``kind`` "op", ``name`` its overload) or a module ("module", ``name`` its scope) raised
        ``error`` when called with ``args``/``kwargs``; called innermost first.  A module's dump holds what its
        forward received (after its forward pre-hooks)."""
        if not isinstance(error, Exception) or dump_of(error) is not None:
            return  # KeyboardInterrupt is no failure; the innermost call is already dumped
        if kind == "op":
            node = torch._C._current_autograd_node()
            if node is not None:  # an op autograd runs: named after the forward module that made its node
                scope = "Gradients/" + (self.spans.module_of(node) or "Default")
            else:
                stack = SUPPRESSION.stack
                scope = stack[-1] if stack else ""
            op, folder = name, f"{scope}/{name}"
        else:
            module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the module it compiles
            scope, op, folder = name, type(module).__name__, name
        meta = self._meta(error, kind, op, scope)
        compiled = compiled_error(str(error))
        if compiled:
            meta["compiled"] = compiled
        if kind == "module":
            args, kwargs, inputs_are = _forward_args(error, module, args, kwargs)
            meta.update(inputs_are=inputs_are, inputs_are_meaning=INPUTS_ARE[inputs_are])
        groups: list[tuple[str, Any]] = [("inputs", list(tensors_in(args, kwargs)))]
        if module is not None:  # a module's own weights are inputs of its ops
            groups.append(("parameters", list(_own_tensors(module))))
        if self.mode == "1":  # outputs that exist: an op's out= tensors; a failing module returned nothing
            out = (kwargs or {}).get("out") if kind == "op" else None
            groups.append(("outputs", list(outputs_in(out)) if out is not None else []))
        self._write(error, folder, meta, groups, frame=sys._getframe(1))

    # -- backward failures --------------------------------------------------------------------
    def _on_backward_error(self, error: BaseException, roots: Any) -> None:
        if not isinstance(error, Exception) or dump_of(error) is not None:
            return
        node, grads = _failing_node(error, roots)
        name = node.name() if node is not None else _node_name(error) or "unknown"
        module = self.spans.module_of(node) if node is not None else ""
        meta = self._meta(error, "backward", name, module)
        meta.update(autograd_node=name, forward_module=module or None)
        groups: list[tuple[str, Any]] = [("inputs", list(tensors_in(grads))), ("saved", list(_saved(node)))]
        self._write(error, f"{module or 'backward'}/{name}", meta, groups, frame=sys._getframe(1))

    # -- writing ------------------------------------------------------------------------------
    def _meta(self, error: BaseException, kind: str, op: str, scope: str) -> dict[str, Any]:
        return {"kind": kind, "op": op, "scope": scope, "step": tracker.step, "mode": self.mode,
                "mode_meaning": MODES[self.mode], "rank": rank(),
                "exception": {"type": type(error).__name__, "message": str(error)}}

    def _write(self, error: BaseException, folder: str, meta: dict[str, Any], groups: Any, frame: Any) -> None:
        meta["python_stack"] = python_stack(error, frame)
        with self._lock, suppressed():
            try:
                path = write_fault_folder(self.root, meta["rank"], "exception_dump", folder, meta, groups,
                                          "exception dump")
            except Exception as exc:  # noqa: BLE001 - reported; the user's own error still propagates
                report_internal_error("exception_dump write", exc)
                return
        self.written.append(path)
        try:
            error._obs_exception_dump = path  # type: ignore[attr-defined]
        except AttributeError:
            pass


_FX_NODE = re.compile(r"FX node with fake tensors: (call_\w+ (?:<[^>]*>|\S+))")
_USER_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)')


def compiled_error(message: str) -> dict[str, str]:
    """What PyTorch says of an error raised while compiling or running compiled code: the FX ``node`` it
    names and the user's ``source`` line (the first frame of "from user code" outside installed packages)."""
    out = {}
    m = _FX_NODE.search(message)
    if m:
        out["node"] = m.group(1)
    _, found, tail = message.partition("from user code:")
    if found:
        import sysconfig

        library = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
        for frame in _USER_FRAME.finditer(tail):
            if not frame.group("path").startswith(library):
                out["source"] = f"{frame.group('path')}:{frame.group('line')}"
                break
    return out


def _forward_args(error: BaseException, module: Any, args: Any, kwargs: Any) -> tuple[Any, Any, str]:
    """``(args, kwargs, INPUTS_ARE key)``: what ``module``'s forward received, given what it was called with."""
    if not (module._forward_pre_hooks or torch.nn.modules.module._global_forward_pre_hooks):
        return args, kwargs, "forward"
    call_impl = torch.nn.Module._call_impl.__code__
    tb = error.__traceback__
    while tb is not None:  # from the wrapper that caught it down: the first _call_impl of this module is this call
        frame = tb.tb_frame
        if frame.f_code is call_impl and frame.f_locals.get("self") is module:
            local = frame.f_locals  # args and kwargs are cells its inner() rebinds after each pre-hook
            inner = tb.tb_next.tb_frame.f_locals if tb.tb_next is not None else {}
            # inner() assigns bw_hook once every pre-hook has returned, right before it calls forward
            reached = "bw_hook" in inner
            return local.get("args", args), local.get("kwargs", kwargs), "forward" if reached else "pre_hook"
        tb = tb.tb_next
    return args, kwargs, "call"


def _own_tensors(module: Any) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _node_name(error: BaseException) -> str | None:
    match = _NODE_IN_MESSAGE.search(str(error))
    return match.group(1) if match else None


def _failing_node(error: BaseException, roots: Any) -> tuple[Any, Any]:
    """(node, gradients handed to it): a custom Function's backward frame first, else the node a message names."""
    backward_cls = torch.autograd.function.BackwardCFunction
    tb = error.__traceback__
    found: tuple[Any, Any] = (None, ())
    while tb is not None:
        local = tb.tb_frame.f_locals
        candidate = local.get("self")
        if isinstance(candidate, backward_cls):
            found = (candidate, local.get("args", ()))
        tb = tb.tb_next
    if found[0] is not None:
        return found
    wanted = _node_name(error)
    if wanted is None:
        return None, ()
    for node in _graph(roots):
        if node.name() == wanted:
            return node, ()
    return None, ()


def _graph(roots: Any, limit: int = 100_000) -> Iterator[Any]:
    """Autograd nodes reachable from ``roots`` (tensors), breadth first, at most ``limit``."""
    if isinstance(roots, torch.Tensor):
        roots = (roots,)
    queue = deque(t.grad_fn for t in (roots or ()) if isinstance(t, torch.Tensor) and t.grad_fn is not None)
    seen: set[int] = set()
    while queue and len(seen) < limit:
        node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        for nxt, _ in node.next_functions:
            if nxt is not None:
                queue.append(nxt)


def _saved(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors autograd still holds for ``node``: a custom Function's saved tensors and tensor attributes,
    a built-in node's ``_saved_*`` fields.  Freed ones are skipped."""
    if node is None:
        return
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        try:
            for i, tensor in enumerate(node.saved_tensors):
                yield f"ctx.saved_tensors[{i}]", tensor
        except RuntimeError:
            pass
        for key, value in vars(node).items():
            if isinstance(value, torch.Tensor):
                yield f"ctx.{key}", value
        return
    for attr in dir(node):
        if not attr.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # already freed by the engine
            continue
        if isinstance(value, torch.Tensor):
            yield attr.removeprefix("_"), value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{attr.removeprefix('_')}[{i}]", item

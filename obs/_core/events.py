"""Every event obs knows, declared once, and the bus that carries them.

Adapters (``obs.runtime.torch``) publish; features (recorder, printsink, exporters) subscribe.
Handlers are called positionally with the event's declared arguments.  A subscription
returns a :class:`Subscription` handle (idempotent ``remove()``, usable as a context
manager).  Adapters watch the bus: an event nobody subscribes to installs no hook at all.
Each event's handlers are one :class:`~obs._core.hooks.Hooks` registry.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from obs._core.hooks import HookHandle, Hooks
from obs._core.internal import report_internal_error

__all__ = ["Event", "EventBus", "EventSpec", "HookValidationError", "Subscription", "bus"]

Handler = Callable[..., Any]


@dataclass(frozen=True)
class EventSpec:
    """Name, positional arguments and meaning of one event."""

    name: str
    args: tuple[str, ...]
    doc: str


class Event(enum.Enum):
    """The events of a training process, in the order a step sees them."""

    STEP_BEGIN = EventSpec("step_begin", ("step",), "A training step starts; `step` counts from 1.")
    STEP_END = EventSpec("step_end", ("step", "duration_ns"), "A training step ended (optimizer.step returned or "
                         "`obs.step()` exited); `duration_ns` is wall time since its begin.")
    MODULE_ENTER = EventSpec("module_enter", ("scope", "module"), "An nn.Module's forward starts; `scope` is its "
                             "MindSpore-style full name, e.g. `Default/net-Net/fc1-Linear`.")
    MODULE_EXIT = EventSpec("module_exit", ("scope", "module", "error"), "An nn.Module's forward returned, or raised "
                            "`error` (None on success).")
    OP = EventSpec("op", ("name", "args", "kwargs", "duration_ns", "error"), "One operator (aten op) ran; `name` is "
                   "its overload name, `args`/`kwargs` its inputs, `error` what it raised or None.")
    PHASE = EventSpec("phase", ("name", "begin_ns", "end_ns"), "A phase of the current training step ended: `name` "
                      "is data (waiting for the batch in `obs.steps`), forward (a root module call with grad enabled), "
                      "backward (torch.autograd.backward) or optimizer (optimizer.step); times are "
                      "time.perf_counter_ns().")
    OP_OUTPUT = EventSpec("op_output", ("name", "args", "kwargs", "output"), "An aten op returned `output` "
                          "(after its OP event); subscribed by the data dump and the NaN check at op granularity.")
    GRAPH_COMPILED = EventSpec("graph_compiled", ("name", "graph_module", "example_inputs"), "`obs.compile` captured "
                               "a graph (a torch.fx.GraphModule) and is about to hand it to the backend; at "
                               "save_graphs >= 2 also each graph after AOT autograd (`graph_module.meta['obs_stage']` "
                               "says which: dynamo_capture, aot_forward, aot_backward, aot_inference, aot_joint).")
    COMPILE_RECORD = EventSpec("compile_record", ("compile_id", "kind", "meta", "payload"), "torch.compile or "
                               "torch.export reported a step of a compile (any backend, obs.compile's too), from "
                               "PyTorch's structured trace: `kind` is dynamo_start, dynamo_output_graph, "
                               "aot_forward_graph, aot_backward_graph, aot_inference_graph, aot_joint_graph, "
                               "inductor_post_grad_graph, inductor_output_code, graph_break, recompile or "
                               "compilation_metrics; `compile_id` is PyTorch's `frame/compile` id (`0/1`); `meta` a "
                               "dict (a graph's: `graph_module`, the FX GraphModule, where PyTorch still holds it; a "
                               "Dynamo graph of a module: `module`, its class, and `classes`, its submodules'); "
                               "`payload` the graph's code or the reason's text ('' when none).")
    GRAPH_STATS = EventSpec("graph_stats", ("spec", "rows"), "An Inductor-compiled graph ran and computed the "
                            "statistics of its tensors (obs.runtime.torch._graph_taps): `rows[i]` holds max, min, "
                            "sum (finite elements), L2 norm, NaN, +Inf, -Inf and zero counts of the tensor "
                            "`spec['rows'][i]` describes (node, op, module stack, dtype, shape); `spec['backward']` "
                            "says whether the graph is a backward graph.  On CUDA `rows` is a `DeviceRows` instead: "
                            "the same values still on the device, not read back (`values`, `split`, `read`).  Also "
                            "when such a graph starts, with `rows` None.")
    GRAPH_IR = EventSpec("graph_ir", ("name", "stage", "text"), "A graph in MindSpore's `.ir` text (obs.graphs): "
                         "every graph obs.compile publishes, the eager trace graph and obs.dump_graph's; `stage` "
                         "says which (dynamo_capture, aot_forward, aot_backward, trace, export, ...).")
    MEMORY = EventSpec("memory", ("step", "stats"), "Memory at each step end: CUDA "
                       "allocator statistics on GPU, process RSS on CPU (read at most 10 ms "
                       "before); `stats` may be the same dict at several step ends: read it, do not change it.")
    COLLECTIVE = EventSpec("collective", ("record",), "A torch.distributed collective changed state "
                           "(scheduled/started/completed); `record` is a dict.")
    PRINT = EventSpec("print", ("values", "meta"), "`obs.Print` was called with `values`; `meta` holds call "
                      "sequence, time, step, rank and source location.")
    FAULT = EventSpec("fault", ("kind", "detail", "error"), "Something failed: `kind` says what (module_error, "
                      "op_error, exception, signal, hang), `detail` where, `error` the exception if any.")
    SETTINGS_CHANGED = EventSpec("settings_changed", ("source", "changes"), "Settings in force changed; `changes` "
                                 "maps key to (old, new), `source` is set_context, reset or the reloaded file.")

    # Identity hash: members are singletons, and Enum's Python-level __hash__ costs ~0.2 µs per
    # handler lookup on the hot path.
    __hash__ = object.__hash__

    @property
    def spec(self) -> EventSpec:
        return self.value


for _member in Event:  # help(obs.Event.STEP_END) shows the event's own contract
    _member.__doc__ = f"{_member.name}({', '.join(_member.value.args)}): {_member.value.doc}"
del _member


class HookValidationError(TypeError):
    """A handler cannot accept the arguments of the event it subscribes to."""


class Subscription(HookHandle[Handler]):
    """Handle of one subscription; ``remove()`` is idempotent, ``with`` removes on exit."""

    __slots__ = ("event",)

    def __init__(self, hooks: Hooks[Handler], event: Event, handler: Handler) -> None:
        super().__init__(hooks, handler)
        self.event = event

    @property
    def handler(self) -> Handler:
        return self.hook


def _check_arity(event: Event, handler: Handler) -> None:
    try:
        sig = inspect.signature(handler)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return
    try:
        sig.bind(*event.spec.args)
    except TypeError as exc:
        raise HookValidationError(
            f"handler {getattr(handler, '__qualname__', handler)!r} cannot subscribe to {event.name}: it must accept "
            f"{len(event.spec.args)} positional argument(s) ({', '.join(event.spec.args)}), but {exc}") from None


class EventBus:
    """One copy-on-write :class:`~obs._core.hooks.Hooks` per event; emitting iterates a snapshot without locking."""

    def __init__(self) -> None:
        self._hooks: dict[Event, Hooks[Handler]] = {
            e: Hooks(f"{e.name} handler", on_change=functools.partial(self._notify, e)) for e in Event}
        self._watchers: Hooks[Callable[[Event], None]] = Hooks("bus watcher")

    def subscribe(self, event: Event, handler: Handler) -> Subscription:
        """Call ``handler(*args)`` on every ``event``; validated now, not at emit time."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be an obs.Event member (got {event!r})")
        if not callable(handler):
            raise TypeError(f"handler for {event.name} must be callable (got {handler!r})")
        _check_arity(event, handler)
        hooks = self._hooks[event]
        return hooks.attach(Subscription(hooks, event, handler))

    def handlers(self, event: Event) -> tuple[Handler, ...]:
        """The current handlers of ``event`` (an immutable snapshot)."""
        return self._hooks[event].snapshot

    def has_subscribers(self, event: Event) -> bool:
        return bool(self._hooks[event].snapshot)

    def emit(self, event: Event, *args: Any) -> None:
        """Deliver one event; a failing handler is reported, never propagated to the caller."""
        # Hooks.call's loop, inlined: calling it would add about 100 ns to every event.
        for handler in self._hooks[event].snapshot:
            try:
                handler(*args)
            except Exception as exc:  # noqa: BLE001 - reported; a handler's bug never reaches the emitter
                report_internal_error(f"{event.name} handler {getattr(handler, '__qualname__', handler)}", exc)

    def watch(self, watcher: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``watcher(event)`` whenever the subscribers of an event change; returns an undo."""
        return self._watchers.add(watcher).remove

    def _notify(self, event: Event) -> None:
        self._watchers.call(event)

    def clear(self) -> None:
        """Remove every subscription (used by ``reset_context`` and tests)."""
        for hooks in self._hooks.values():
            hooks.clear()


bus = EventBus()

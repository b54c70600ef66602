"""``obs.compile``: torch.compile through an obs backend in GRAPH_MODE, eager in PYNATIVE_MODE.

The backend publishes GRAPH_COMPILED for every graph Dynamo captures (graph dumps and the
recorder subscribe to it), then hands the graph to the real backend (inductor by default).
At ``save_graphs`` >= 2 it also publishes the forward and backward graphs after AOT autograd (and,
at 3, the joint graph before partitioning): inductor's are taken from its ``inner_compile``, an
AOT-autograd backend's (``aot_eager``...) from its compilers, and any other backend is run behind
AOT autograd with the inner backend compiling each graph.  Each graph's ``meta`` says what it is:
``obs_stage`` (``dynamo_capture``, ``aot_forward``, ``aot_backward``, ``aot_inference``, ``aot_joint``),
``obs_root`` (the compiled module's class), ``obs_parent`` (the Dynamo graph an AOT graph came from).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from obs._core.demands import demands
from obs._core.events import Event, bus
from obs._core.internal import suppressed
from obs.runtime.steps import tracker

__all__ = ["OWN_COMPILES", "ObsBackend", "compile"]

#: PyTorch's ids (``frame/compile``) of the compiles obs.compile's backend made (their graphs are written as .ir)
OWN_COMPILES: set[str] = set()

F = TypeVar("F", bound=Callable[..., Any])

_counter = itertools.count()
_counter_lock = threading.Lock()


class ObsBackend:
    """A torch.compile backend: publish the captured graph, then delegate to ``inner``."""

    def __init__(self, name: str, inner: str | Callable[..., Any] = "inductor", root: str | None = None,
                 classes: dict[str, str] | None = None) -> None:
        self.name = name
        self.inner = inner
        self.root = root
        self.classes = classes  # qualified name -> class of the compiled module's submodules (for scopes)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with _counter_lock:
            index = next(_counter)
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None:
            OWN_COMPILES.add(str(compile_id))
        self.graphs += 1
        name = f"{self.name}_{index}"
        backend = self.inner if isinstance(self.inner, str) else getattr(self.inner, "__name__", "custom")
        gm.meta.update(obs_stage="dynamo_capture", obs_root=self.root, obs_backend=backend, obs_classes=self.classes)
        with suppressed():
            bus.emit(Event.GRAPH_COMPILED, name, gm, example_inputs)
        inner = self.inner
        stages = demands.graph_level()
        if stages >= 2:
            from obs.runtime.torch._stages import staged

            inner = staged(inner, name, gm, joint=stages >= 3)
        elif isinstance(inner, str):
            from torch._dynamo import lookup_backend

            inner = lookup_backend(inner)
        # The graph is no module of the user's: run its code, not Module.__call__, which would add a
        # module event of its own (a lazy GraphModule's saved forward calls it on every run).
        getattr(gm, "real_recompile", lambda: None)()
        compiled = inner(gm, example_inputs)
        if isinstance(compiled, torch.nn.Module):
            compiled = compiled.forward

        grad_enabled = torch.is_grad_enabled

        def run(*args: Any) -> Any:
            # Module hooks fold away inside compiled graphs, so the graph call marks step starts;
            # a call under no_grad / inference_mode between steps is evaluation and opens none.
            if not tracker.in_step and grad_enabled():
                tracker.auto_begin()
            return compiled(*args)

        return run


def compile(model_or_fn: F, *, backend: str | Callable[..., Any] = "inductor", **kwargs: Any) -> F:
    """Compile ``model_or_fn`` when ``mode`` is GRAPH_MODE; return it unchanged in PYNATIVE_MODE.

    ``backend`` is the backend that finally runs the graph; ``kwargs`` go to ``torch.compile``.
    """
    from obs.settings._context import get_context
    from obs.settings.context_options import GRAPH_MODE

    if get_context("mode") != GRAPH_MODE:
        return model_or_fn
    name = getattr(model_or_fn, "__name__", None) or type(model_or_fn).__name__
    root = classes = None
    if isinstance(model_or_fn, torch.nn.Module):
        root = type(model_or_fn).__name__
        classes = {qualified: type(sub).__name__ for qualified, sub in model_or_fn.named_modules() if qualified}
    return torch.compile(model_or_fn, backend=ObsBackend(name, backend, root, classes), **kwargs)  # type: ignore[return-value]

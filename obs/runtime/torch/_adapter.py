"""Installs exactly the PyTorch hooks that current subscribers need, and removes them when they leave.

- STEP_BEGIN / STEP_END / MEMORY, or a feature's ``tracker.require(...)`` (Print to file) → global
  optimizer step hooks (a step ends when optimizer.step returns; explicit ``obs.step()`` takes precedence), the same
  pair as PHASE's optimizer phase.
- MODULE_ENTER / MODULE_EXIT → a wrapper of ``nn.Module.__call__`` with scope names.
- OP / OP_OUTPUT → a dispatch mode on the subscribing thread.
- COLLECTIVE → wrappers of the torch.distributed collectives.
- COMPILE_RECORD → a handler on PyTorch's structured-trace logger (every compile in the process).
- GRAPH_STATS → a post-grad pass of Inductor that has compiled graphs compute their tensors' statistics.
- PHASE → a wrapper of ``torch.autograd.backward``, optimizer step hooks, and the module wrapper (root calls).
No subscriber, no hook: the bus (and the step tracker, for demands) tells the adapter whenever
subscriptions change.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from obs._core.events import Event, bus
from obs.runtime import resident
from obs.runtime.steps import tracker
from obs.runtime.torch._modules import ModuleHooks, current_scope
from obs.runtime.torch._ops import OpInterceptor
from obs.runtime.torch._phases import TrainingHooks

__all__ = ["TorchAdapter", "adapter", "current_scope", "memory_stats"]

STEP_EVENTS = (Event.STEP_BEGIN, Event.STEP_END, Event.MEMORY)
MODULE_EVENTS = (Event.MODULE_ENTER, Event.MODULE_EXIT)


def memory_stats() -> dict[str, Any]:
    """CUDA allocator statistics where CUDA is in use, else the process's RSS (bytes), read at most 10 ms before
    (:mod:`obs.runtime.resident`).

    The device is ``set_context``'s, or CUDA's current device when that is CPU (the default) and the process uses
    CUDA.  Peaks are since the previous reading (one per step end): the allocator's peak counters are reset after
    each reading, without a device sync, so ``torch.cuda.max_memory_allocated()`` gives the peak since the last
    step end too.
    """
    dev = None
    if torch.cuda.is_initialized():  # else RSS, whatever the context's device: no settings lookup per step end
        from obs.runtime.torch._device import device

        dev = device()
    if dev is not None and dev.type in ("cuda", "cpu"):
        if dev.type == "cpu":
            dev = torch.device("cuda", torch.cuda.current_device())
        # The nested dict: flattening all of memory_stats()'s few hundred keys in Python costs more than the read.
        stats = torch.cuda.memory_stats_as_nested_dict(dev)
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        torch.cuda.reset_peak_memory_stats(dev)  # host-side counters under the allocator's lock: no sync
        return {"device": str(dev), "allocated_bytes.all.current": allocated.get("current", 0),
                "allocated_bytes.all.peak": allocated.get("peak", 0),
                "reserved_bytes.all.current": reserved.get("current", 0),
                "reserved_bytes.all.peak": reserved.get("peak", 0),
                "num_alloc_retries": stats.get("num_alloc_retries", 0), "num_ooms": stats.get("num_ooms", 0)}
    return resident.latest()  # the CPU: a system call at most every 10 ms, the newest reading in between


class TorchAdapter:
    """Keeps the installed hooks in line with the bus's subscriptions."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._training = TrainingHooks()  # the optimizer step hooks (steps, the optimizer phase) and backward's
        self._modules: ModuleHooks | None = None
        self._ops: OpInterceptor | None = None
        self._collectives: Any = None
        self._compile_log: Any = None
        self._graph_stats: Any = None  # the pass placed in Inductor's post_grad_custom_post_pass
        tracker.memory_probe = memory_stats
        self._unwatch = bus.watch(self._on_change)
        self._unwatch_demands = tracker.watch(self.sync)
        self.sync()

    @property
    def installed(self) -> dict[str, bool]:
        """Which hook families are in place (for tests and ``obs demo``)."""
        return {"steps": self._training.steps, "modules": self._modules is not None, "ops": self._ops is not None,
                "collectives": self._collectives is not None, "phases": bool(self._training.handlers),
                "compiles": self._compile_log is not None, "graph_stats": self._graph_stats is not None}

    def _on_change(self, event: Event) -> None:
        if event is not Event.SETTINGS_CHANGED:
            self.sync()

    def sync(self) -> None:
        with self._lock:
            want_steps = tracker.wanted or any(bus.has_subscribers(e) for e in STEP_EVENTS)
            phases = bus.handlers(Event.PHASE)
            self._training.sync(steps=want_steps, handlers=phases)

            want_modules = bool(phases) or any(bus.has_subscribers(e) for e in MODULE_EVENTS)  # phases: root calls
            if want_modules and self._modules is None:
                from obs.settings._context import get_context

                self._modules = ModuleHooks(get_context("reserve_class_name_in_scope"))
            elif not want_modules and self._modules is not None:
                self._modules.remove()
                self._modules = None
            if self._modules is not None:
                self._modules.refresh()

            want_ops = bus.has_subscribers(Event.OP) or bus.has_subscribers(Event.OP_OUTPUT)
            if want_ops and self._ops is None:
                self._ops = OpInterceptor().install()
            elif not want_ops and self._ops is not None:
                self._ops.remove()
                self._ops = None

            want_compiles = bus.has_subscribers(Event.COMPILE_RECORD)
            if want_compiles and self._compile_log is None:
                from obs.runtime.torch._compile_log import CompileLog

                self._compile_log = CompileLog()
            elif not want_compiles and self._compile_log is not None:
                self._compile_log.remove()
                self._compile_log = None

            want_stats = bus.has_subscribers(Event.GRAPH_STATS)
            if want_stats != (self._graph_stats is not None):
                self._graph_stats = _graph_stats_pass(want_stats, self._graph_stats)

            want_collectives = bus.has_subscribers(Event.COLLECTIVE) and torch.distributed.is_available()
            if want_collectives and self._collectives is None:
                from obs.runtime.torch._collectives import CollectiveHooks

                self._collectives = CollectiveHooks()
            elif not want_collectives and self._collectives is not None:
                self._collectives.remove()
                self._collectives = None

    def close(self) -> None:
        """Remove every hook and stop following the bus."""
        self._unwatch()
        self._unwatch_demands()
        tracker.memory_probe = None
        with self._lock:
            self._training.remove()
            if self._modules is not None:
                self._modules.remove()
                self._modules = None
            if self._ops is not None:
                self._ops.remove()
                self._ops = None
            if self._collectives is not None:
                self._collectives.remove()
                self._collectives = None
            if self._compile_log is not None:
                self._compile_log.remove()
                self._compile_log = None
            if self._graph_stats is not None:
                self._graph_stats = _graph_stats_pass(False, self._graph_stats)


def _graph_stats_pass(on: bool, installed: Any) -> Any:
    """Put the graph statistics pass in Inductor's post-grad passes (beside any of the user's), or take it out."""
    from torch._inductor import config

    from obs.runtime.torch import _graph_taps

    passes = config.post_grad_custom_post_pass
    passes = list(passes) if isinstance(passes, (list, tuple)) else [] if passes is None else [passes]
    if on:
        installed = _graph_taps.GraphStatsPass()
        passes.append(installed)
    else:
        passes = [p for p in passes if p is not installed]
        installed = None
    config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else (passes or None)
    _graph_taps.listen(on)
    return installed


adapter = TorchAdapter()

"""obs: an observability and debugging runtime for PyTorch training, in MindSpore's ``set_context`` style.

This module is the wiring (docs/architecture.md): it re-exports the public API and installs the
features' appliers.  ``import obs`` is light: torch, opentelemetry and rich are imported only by the
features and commands that need them, and nothing starts unless the environment asks for it
(``MS_RDR_ENABLE``, ``MS_DEV_SAVE_GRAPHS``, MindSpore's variables; docs/architecture.md, "MindSpore, the
original", says which MindSpore obs follows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from obs._core.errors import DeviceUnavailableError, ObsConfigError, ObsError
from obs._core.events import Event, EventBus, HookValidationError, Subscription, bus
from obs._core.internal import internal_error_counts
from obs._core.version import __version__
from obs.features import device as _device
from obs.features import device_context, dump, graphs, ops, profiling, rdr
from obs.features import env_config as _env_config
from obs.features import monitor as _monitor
from obs.features import printing as _printing
from obs.features import torch_check as _torch_check
from obs.features.dump import feature as _dump
from obs.features.env_config import ObsConfigWarning, env_config
from obs.features.graphs import dump_graph
from obs.features.printing import Print
from obs.features.profiling.scalars import scalar
from obs.runtime import loader as _loader
from obs.runtime.steps import step, steps
from obs.settings._context import get_context, register_applier, reset_context, set_context
from obs.settings.context_options import COMPATIBLE, DEBUG, GRAPH_MODE, LAX, PYNATIVE_MODE, RELEASE, STRICT
from obs.settings.parallel import (
    ParallelMode,
    get_auto_parallel_context,
    get_ps_context,
    rank,
    reset_auto_parallel_context,
    reset_ps_context,
    set_auto_parallel_context,
    set_ps_context,
    world_size,
)
from printsink.reader import parse_print

__all__ = [
    "COMPATIBLE", "DEBUG", "GRAPH_MODE", "LAX", "PYNATIVE_MODE", "RELEASE", "STRICT", "DeviceUnavailableError",
    "Event", "EventBus", "HookValidationError", "ObsConfigError", "ObsConfigWarning", "ObsError", "ParallelMode",
    "Print", "Subscription", "__version__", "bus", "compile", "device", "device_context", "dump", "dump_graph",
    "env_config", "get_auto_parallel_context", "get_context", "get_ps_context", "graphs", "internal_error_counts",
    "ops", "parse_print", "profiling", "rank", "rdr", "reset_auto_parallel_context", "reset_context",
    "reset_ps_context", "scalar", "set_auto_parallel_context", "set_context", "set_ps_context", "step", "steps",
    "subscribe", "world_size",
]


if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def subscribe(event: Event, handler: Callable[..., Any]) -> Subscription:
    """Call ``handler(*args)`` on every ``event`` (see :class:`Event` for the arguments); returns a handle."""
    return bus.subscribe(event, handler)


_LAZY = {"device": "obs.runtime.torch", "compile": "obs.runtime.torch"}


def __getattr__(name: str) -> Any:
    """``obs.compile`` and ``obs.device`` load the PyTorch adapter on first use (``import obs`` stays light)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'obs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


#: Every feature's applier, in the order a settings change reaches them.
FEATURES = (_torch_check.feature, _env_config.feature, _device.feature, _printing.feature, rdr.feature,
            profiling.feature, _dump.feature, graphs.feature, _monitor.feature)


class _PublicPaths:
    """The public namespaces stay importable as module paths (``from obs.dump import DumpReader``, ``import
    obs.dump.diff``): each maps to its room under ``obs.features``, and yields the same module objects."""

    ROOMS = (("obs.dump", "obs.features.dump"), ("obs.graphs", "obs.features.graphs"), ("obs.rdr", "obs.features.rdr"),
             ("obs.profiling", "obs.features.profiling"), ("obs.ops", "obs.features.ops"),
             ("obs.device_context", "obs.features.device_context"))

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        for public, room in self.ROOMS:
            if name == public or name.startswith(public + "."):
                import importlib
                import importlib.util

                module = importlib.import_module(room + name[len(public):])
                return importlib.util.spec_from_loader(name, _Same(module))
        return None


class _Same:
    """A loader that hands back an already imported module."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def create_module(self, spec: Any) -> Any:
        return self.module

    def exec_module(self, module: Any) -> None:
        pass


def _install() -> None:
    import sys

    sys.meta_path.insert(0, _PublicPaths())
    for feature in FEATURES:
        register_applier(feature)
    _loader.install()  # the PyTorch adapter loads when a subscriber or a demand needs it
    rdr.start_from_environment()
    graphs.feature.from_environment()


_install()

del annotations, TYPE_CHECKING  # the public namespace holds obs's names only

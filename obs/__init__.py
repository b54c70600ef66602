"""obs: an observability and debugging runtime for PyTorch training, in MindSpore's ``set_context`` style.

``import obs`` is light: torch, opentelemetry and rich are imported only by the features and
commands that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from obs import device_context, dump, graphs, ops, profiling, rdr
from obs._core.errors import DeviceUnavailableError, ObsConfigError, ObsError
from obs._core.events import Event, EventBus, HookValidationError, Subscription, bus
from obs._core.internal import internal_error_counts
from obs.printing import Print
from obs.dump.feature import feature as _dump_feature
from obs.graphs import dump_graph
from obs.printing import feature as _print_feature
from obs.runtime import _activation
from obs.runtime._torch_settings import TorchSettings
from obs.runtime.steps import step, steps
from obs.settings import _env_feature
from obs.settings._context import get_context, register_applier, reset_context, set_context
from obs.settings._env_feature import ObsConfigWarning, env_config
from obs.settings.context_options import COMPATIBLE, DEBUG, GRAPH_MODE, LAX, PYNATIVE_MODE, RELEASE, STRICT
from obs.settings.parallel import (ParallelMode, get_auto_parallel_context, get_ps_context, rank,
                                   reset_auto_parallel_context, reset_ps_context, set_auto_parallel_context,
                                   set_ps_context, world_size)
from printsink.reader import parse_print

__version__ = "0.1.0"

__all__ = [
    "COMPATIBLE", "DEBUG", "DeviceUnavailableError", "Event", "EventBus", "GRAPH_MODE", "HookValidationError", "LAX",
    "ObsConfigError", "ObsConfigWarning", "ObsError", "PYNATIVE_MODE", "Print", "ParallelMode", "RELEASE", "STRICT",
    "Subscription", "__version__", "bus", "compile", "device", "device_context", "dump", "dump_graph", "env_config",
    "get_auto_parallel_context", "get_context", "get_ps_context", "internal_error_counts", "ops", "parse_print",
    "graphs", "rank", "rdr",
    "reset_auto_parallel_context", "reset_context", "reset_ps_context", "set_auto_parallel_context",
    "set_context", "set_ps_context", "step", "steps", "subscribe", "world_size",
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


register_applier(_env_feature.feature)
register_applier(TorchSettings())
register_applier(_print_feature)
register_applier(rdr.feature)
register_applier(profiling.feature)
register_applier(_dump_feature)
register_applier(graphs.feature)
_activation.install()
rdr.start_from_environment()
graphs.feature.from_environment()

del annotations, TYPE_CHECKING  # the public namespace holds obs's names only

"""The PyTorch adapter: device controls, step/module/op hooks, the obs.compile backend.

Importing this package imports torch; nothing else in ``import obs`` does.  It refuses a torch obs does not
support first (:mod:`obs.runtime.torch_support`), before anything touches torch's internals.

The names below are what features use of the adapter; its underscore modules are its own.  Two load on first
use (:data:`_LAZY`), because importing them registers custom ops with torch.
"""

from typing import TYPE_CHECKING, Any

from obs.runtime.torch_support import check

check()

from obs.runtime.torch._adapter import adapter, current_scope  # noqa: E402
from obs.runtime.torch._autograd_calls import AutogradCall  # noqa: E402
from obs.runtime.torch._compile import OWN_COMPILES, compile  # noqa: E402
from obs.runtime.torch._controls import apply as apply_controls  # noqa: E402
from obs.runtime.torch._controls import restore as restore_controls  # noqa: E402
from obs.runtime.torch._device import check_device, device  # noqa: E402
from obs.runtime.torch._dynamo_polyfill import hidden_from_dynamo, skip_frames  # noqa: E402
from obs.runtime.torch._exports import ExportHook  # noqa: E402
from obs.runtime.torch._failures import failure_hooks  # noqa: E402
from obs.runtime.torch._flight_recorder import add_to_bundle as add_flight_recorder_to_bundle  # noqa: E402
from obs.runtime.torch._modules import forget_scopes  # noqa: E402
from obs.runtime.torch._ops import set_inputs_before_writes  # noqa: E402
from obs.runtime.torch._p2p import Peer, same_ops  # noqa: E402

if TYPE_CHECKING:
    from obs.runtime.torch._collectives import remap_torchs_own
    from obs.runtime.torch._graph_taps import DeviceRows
    from obs.runtime.torch._module_taps import ModuleTaps
    from obs.runtime.torch._print_op import print_in_graph

__all__ = ["OWN_COMPILES", "AutogradCall", "DeviceRows", "ExportHook", "add_flight_recorder_to_bundle", "adapter",
           "apply_controls", "check_device", "compile", "current_scope", "device", "failure_hooks", "forget_scopes",
           "hidden_from_dynamo", "print_in_graph", "restore_controls", "set_inputs_before_writes", "skip_frames"]
__all__ += ["ModuleTaps", "Peer", "remap_torchs_own", "same_ops"]

_LAZY = {"DeviceRows": "obs.runtime.torch._graph_taps", "print_in_graph": "obs.runtime.torch._print_op",
         "ModuleTaps": "obs.runtime.torch._module_taps", "remap_torchs_own": "obs.runtime.torch._collectives"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'obs.runtime.torch' has no attribute {name!r}")

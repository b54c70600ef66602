"""The PyTorch adapter: device controls, step/module/op hooks, the obs.compile backend.

Importing this package imports torch; nothing else in ``import obs`` does.
"""

from obs.runtime.torch._adapter import adapter, current_scope
from obs.runtime.torch._compile import compile
from obs.runtime.torch._device import device

__all__ = ["adapter", "compile", "current_scope", "device"]

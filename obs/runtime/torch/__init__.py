"""The PyTorch adapter: device controls, step/module/op hooks, the obs.compile backend.

Importing this package imports torch; nothing else in ``import obs`` does.  It refuses a torch obs does not
support first (:mod:`obs.runtime.torch_support`), before anything touches torch's internals.
"""

from obs.runtime.torch_support import check

check()

from obs.runtime.torch._adapter import adapter, current_scope  # noqa: E402
from obs.runtime.torch._compile import compile  # noqa: E402
from obs.runtime.torch._device import device  # noqa: E402
from obs.runtime.torch._failures import failure_hooks  # noqa: E402

__all__ = ["adapter", "compile", "current_scope", "device", "failure_hooks"]

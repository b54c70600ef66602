"""The parameters' norms at an optimizer step: each gradient's norm, each parameter's norm before the step, and the
norm of the change the step made (the update), for one optimizer's list of watched parameters.

Two paths compute the same values:

* **native** (CPU parameters of float32, float16 or bfloat16, contiguous; the C module ``_norms`` built by
  ``setup.py``): one call for the gradients' norms (one pass over each at memory speed, the list of norms as Python
  floats: no tensor made per parameter), one call before the step copying each parameter's sample into one float32
  buffer and taking its norms, one call after it for the norms of the change;
* **torch** (anything else, a GPU, or ``OBS_NATIVE_STATS=0``): fused ops, ``torch._foreach_norm`` and
  ``torch._foreach_copy_`` / ``torch._foreach_sub_`` on buffers kept from step to step, the norms left in one tensor
  on the parameters' device (no host read here).

The sample: a parameter of more than ``sample`` elements takes part in the update norm and ratio through
:data:`RUNS` runs of ``sample // RUNS`` contiguous elements, evenly spaced over it (runs rather than single elements
spread out: they read as few cache lines as they have elements); its update norm is scaled to the whole by
``sqrt(numel / sampled)``.  ``sample`` 0: every element (an exact update, a copy of every parameter each step).
Gradient norms are always exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from obs._core import native
from obs._core.internal import suppressed

__all__ = ["CODES", "EXTENSION", "RUNS", "ParamNorms", "sample_layout"]

#: The C pass (part ``STATS`` of ``OBS_NATIVE``'s switches, with the data dump's statistics pass).
EXTENSION = native.Installed("obs.features.monitor._norms", "STATS")

RUNS = 32  #: runs per sampled parameter
#: The dtypes of the native pass, and their codes (those of the data dump's statistics pass, _stats_api.h).
CODES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}


def sample_layout(numel: int, sample: int) -> tuple[int, int, int]:
    """``(runs, length, spacing)`` of a parameter's sample: ``runs`` runs of ``length`` elements, ``spacing`` apart
    (the whole parameter: one run)."""
    if sample <= 0 or numel <= sample:
        return 1, numel, numel
    runs = min(RUNS, sample)
    return runs, sample // runs, numel // runs


class ParamNorms:
    """One optimizer's watched parameters (a fixed list): :meth:`before` the step, :meth:`after` it.

    ``before`` returns what ``after`` needs; ``after`` returns the step's norms, gradients then updates then weights
    (one list of floats on the native path, one tensor on the torch path), and each parameter's factor from its
    sample's update norm to the whole."""

    def __init__(self, params: list[torch.Tensor], sample: int, *, native: bool = True) -> None:
        self.params, self.sample, self.native = params, sample, native
        self.layouts = [sample_layout(p.numel(), sample) if p.is_contiguous() else (1, p.numel(), p.numel())
                        for p in params]
        self.scales = tuple(math.sqrt(p.numel() / (r * n)) if r * n else 1.0
                            for p, (r, n, _) in zip(params, self.layouts))
        self._lib: Any = None
        self._addresses: list[int] = []
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] | None = None
        self._buffers: list[torch.Tensor] | None = None
        self._plan_native()

    # -- native ----------------------------------------------------------------------------------------------------
    def _plan_native(self) -> None:
        """The native path when every parameter allows it (and the module loads), with its fixed arguments."""
        params = self.params
        lib = EXTENSION.load() if self.native else None
        if lib is None or not all(p.device.type == "cpu" and p.dtype in CODES and p.is_contiguous() for p in params):
            self._lib = None
            return
        self._codes = tuple(CODES[p.dtype] for p in params)
        self._counts = tuple(p.numel() for p in params)
        self._runs = tuple(r for r, _, _ in self.layouts)
        self._lengths = tuple(n for _, n, _ in self.layouts)
        self._spacings = tuple(s for _, _, s in self.layouts)
        self._buffer = torch.empty(sum(r * n for r, n, _ in self.layouts), dtype=torch.float32)
        self._address = self._buffer.data_ptr()
        self._addresses = [p.data_ptr() for p in params]
        self._lib = lib

    def before(self, grads: list[torch.Tensor]) -> Any:
        lib = self._lib
        if lib is not None:
            addresses = [p.data_ptr() for p in self.params]
            if addresses != self._addresses:  # a parameter's memory moved (``p.data = ...``): planned again
                self._plan_native()
                if self._lib is None:
                    return self._before_torch(grads)
            if all([g.is_contiguous() for g in grads]):
                grad_norms = lib.norms([g.data_ptr() for g in grads], self._counts, self._codes)
            else:  # a gradient of another layout (channels_last): torch's norm for it, the native pass for the rest
                dense = [i for i, g in enumerate(grads) if g.is_contiguous()]
                with torch.no_grad(), suppressed():
                    grad_norms = [float(n) for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]
                for i, n in zip(dense, lib.norms([grads[i].data_ptr() for i in dense],
                                                 [self._counts[i] for i in dense], [self._codes[i] for i in dense])):
                    grad_norms[i] = n
            weight_norms = lib.sample(addresses, self._runs, self._lengths, self._spacings, self._codes,
                                      self._address)
            return grad_norms, weight_norms, addresses
        return self._before_torch(grads)

    def after(self, pending: Any) -> Any:
        if len(pending) == 3:
            grad_norms, weight_norms, addresses = pending
            if [p.data_ptr() for p in self.params] != addresses:  # moved during the step: no update to measure
                return grad_norms + [math.nan] * len(addresses) + weight_norms
            updates = self._lib.update(addresses, self._runs, self._lengths, self._spacings, self._codes,
                                       self._address)
            return grad_norms + updates + weight_norms
        return self._after_torch(pending)

    def updates(self, pending: Any) -> list[torch.Tensor]:
        """The torch path's buffers after :meth:`after`: each parameter's (sample's) value before the step minus
        after it."""
        return pending[3]

    # -- torch -----------------------------------------------------------------------------------------------------
    def _torch_views(self) -> list[torch.Tensor]:
        """Each parameter's sample as a view (cached while the parameters' memory stays where it was)."""
        views = self._views
        if views is not None and all(v.data_ptr() == p.data_ptr() or v.numel() == 0
                                     for v, p in zip(views, self.params)):
            return views
        views = []
        for p, (runs, length, spacing) in zip(self.params, self.layouts):
            flat = p.detach()
            if runs > 1:
                flat = flat.view(-1)[:runs * spacing].view(runs, spacing)[:, :length]
            views.append(flat)
        self._views = views
        self._buffers = None
        return views

    def _before_torch(self, grads: list[torch.Tensor]) -> Any:
        with torch.no_grad(), suppressed():
            return self._before_ops(grads)

    def _before_ops(self, grads: list[torch.Tensor]) -> Any:
        views = self._torch_views()
        buffers = self._buffers
        if buffers is None or any(b.device != v.device for b, v in zip(buffers, views)):
            # float32 for 16-bit parameters: the difference (a small change of a large value) is not rounded to 16 bits
            buffers = self._buffers = [
                torch.empty(v.shape, dtype=torch.float32 if v.dtype in (torch.bfloat16, torch.float16) else v.dtype,
                            device=v.device) for v in views]
        grad_norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # 16-bit norms in float32, as the native
        weight_norms = torch._foreach_norm(views, 2, dtype=torch.float32)
        torch._foreach_copy_(buffers, views)
        return grad_norms, weight_norms, views, buffers

    def _after_torch(self, pending: Any) -> torch.Tensor:
        with torch.no_grad(), suppressed():
            return self._after_ops(pending)

    def _after_ops(self, pending: Any) -> torch.Tensor:
        grad_norms, weight_norms, views, buffers = pending
        torch._foreach_sub_(buffers, views)  # the value before the step, minus after: -update (of the samples)
        update_norms = torch._foreach_norm(buffers, 2, dtype=torch.float32)
        return torch.stack([*grad_norms, *update_norms, *weight_norms])  # one tensor, one read

"""DDP's unreduced gradients (msprobe's ``grad_unreduced``): each rank's own gradient, before the all-reduce makes
them the same on every rank, so that a rank whose gradients alone went bad (a faulty device) is told apart from one
whose data did.

With ``wg_distribution`` in a job of more than one rank (torch.distributed initialised at the first optimizer step),
every parameter the optimizer steps gets a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``).
It runs inside the gradient's accumulation, before the node's post hooks, among which DDP's reducer copies the
gradient into its bucket and launches the all-reduce: the gradient it sees is the rank's own.  It keeps the
statistics of ``ops`` of it (one small tensor, no host read); the collector puts them into the step's packet as
``grad_unreduced`` rows.  The hooks are installed at the first optimizer step, so the first step has none.  Under
gradient accumulation, the statistics are those of the gradient accumulated by the last backward of the step.
Nothing changes in the model: the hook reads the gradient under ``torch.no_grad()`` with obs's hooks suppressed.
"""

from __future__ import annotations

from typing import Any

import torch

from obs._core.internal import report_internal_error, suppressed
from obs.features.monitor.collect import Collector
from obs.features.monitor.names import matches
from obs.features.monitor.stats import shape_of, stats
from obs.features.monitor.step_plan import same_rows
from obs.features.monitor.writer import Block

__all__ = ["Unreduced"]


class Unreduced:
    """The hooks of one monitor run's unreduced gradients; :meth:`remove` takes them out."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self._decided = False
        self._handles: list[Any] = []
        self._params: list[torch.Tensor] = []
        self._stats: dict[int, torch.Tensor] = {}
        self._rows: tuple[Any, ...] = ()
        collector.extras.append(self)

    def __call__(self, opt: Any, step: int) -> tuple[Block, torch.Tensor] | None:
        """The collector's extra block of this step: the statistics kept since the last step, in the optimizer's
        order; at the first step, the hooks installed (when the job has more than one rank)."""
        if not self._decided:
            self._decided = True
            self._install(opt)
        if not self._stats:
            return None
        plan, names = self.collector.plan, self.collector._names
        rows, values = [], []
        for i, p in enumerate(self._params):
            got = self._stats.get(id(p))
            name = names.get(id(p), f"param_{i}")
            if got is not None and matches(name, plan.targets):
                rows.append((name, None, shape_of(p), str(p.dtype)))
                values.append(got)
        self._stats = {}
        if not rows:
            return None
        self._rows = same_rows(rows, self._rows)
        return Block("grad_unreduced", self._rows, plan.value_ops), torch.cat(values)

    def _install(self, opt: Any) -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        collector = self.collector
        plan = collector.plan
        ops, eps = plan.value_ops, plan.eps

        def hook(param: torch.Tensor) -> None:
            try:
                if param.grad is not None and plan.due(collector._step_now):
                    with torch.no_grad(), suppressed():
                        self._stats[id(param)] = stats(param.grad, ops, eps)
            except Exception as exc:  # noqa: BLE001 - reported; never raised into backward
                report_internal_error("monitor: unreduced gradients", exc)

        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._params.append(p)
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._params, self._stats = [], [], {}

"""Activations of a compiled model: the monitor's ``actv`` rows from graph taps, not module hooks.

A forward hook on a module inside ``torch.compile`` is traced into the compiled graph (or breaks it), which changes
what is compiled.  When the model the monitor learns is a compiled one (``torch.compile(model)``, an
``OptimizedModule``), its chosen modules get no hook: the training graphs compiled from then on tap their inputs and
outputs (:class:`obs.runtime.torch.ModuleTaps`: after AOT autograd, Inductor's kernels left as they are, aot_eager's
ops run one by one), and hand each graph call's rows here, where they join the step's ``actv`` block as the hooks'
rows do: the module's name (Dynamo's module path, without ``_orig_mod.``), the call within the step as micro step,
the statistics of ``ops`` (the hooks' own function, one float32 vector per value, on its device, nothing read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from obs.features.monitor.collect import Collector

__all__ = ["compiled_root", "take_over"]


def compiled_root(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wraps when ``module`` is its wrapper (``OptimizedModule``), else None."""
    inner = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module):
        return inner
    return None


def take_over(collector: Collector, root: torch.nn.Module, chosen: Callable[[str], bool],
              stats: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The graph taps of the activations of ``root``, installed, when it is a compiled model (None otherwise); the
    caller keeps them and removes them with its hooks.  ``chosen(name)``: whether a module's activations are
    recorded; ``stats(tensor)``: their statistics, as the hooks compute them."""
    if compiled_root(root) is None:
        return None
    if id(root) in collector._hooked:  # a model learnt twice (a second optimizer's): tapped once
        return _Nothing()
    collector._hooked.add(id(root))
    from obs.runtime.torch import ModuleTaps

    plan = collector.plan
    if not plan.xy:  # print_struct alone: no activations, and no hook in the compiled model either
        return _Nothing()

    acts = collector._acts

    def on_rows(rows: list[dict[str, Any]], values: torch.Tensor) -> None:
        if not acts.due:
            return
        calls = acts.calls
        micro_of: dict[tuple[str, str], int] = {}
        for row in rows:
            module, key = row["module"], (row["module"], row["call"])
            micro = micro_of.get(key)
            if micro is None:  # a module's next call in this step
                micro = micro_of[key] = calls.get(module, 0)
                calls[module] = micro + 1
            label = row["io"] if row["count"] == 1 else f"{row['io']}_{row['slot']}"
            acts.rows.append((f"{module}.{label}", micro, str(row["shape"]), row["dtype"]))
        acts.parts.append(values.reshape(-1))

    return ModuleTaps(chosen, stats, len(plan.value_ops), on_rows).install()


class _Nothing:
    def remove(self) -> None:
        return None

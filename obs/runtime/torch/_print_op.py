"""Print inside ``torch.compile``: a registered custom op with side effects, so no graph break.

The tensors travel as op inputs; strings and Python scalars are constants of the trace, packed
into one JSON ``spec`` string (custom ops take no ``str[]``) with the call site: Dynamo knows which
user line it is tracing, so a compiled Print records ``model.py:188`` as eager mode does.  At run
time the op rebuilds the call and hands it to the eager Print path.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from obs._core.demands import demands

__all__ = ["print_in_graph"]

_OBS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_UNKNOWN = "<compiled graph>"


def _flatten(values: Any, out: list[Any]) -> list[Any]:
    for value in values:
        if isinstance(value, (tuple, list)):
            _flatten(value, out)
        else:
            out.append(value)
    return out


def _traced_call_site() -> str:
    """``file:line`` of the user's frame that Dynamo is tracing: the innermost traced frame outside obs
    (inlined calls included)."""
    try:
        from torch._guards import TracingContext

        stack = TracingContext.extract_stack()
    except Exception:  # noqa: BLE001 - a torch without this internal: the source is just unknown
        return _UNKNOWN
    for frame in reversed(stack):
        if not os.path.abspath(frame.filename).startswith(_OBS_DIR):
            return f"{frame.filename}:{frame.lineno}"
    return _UNKNOWN


@torch.compiler.assume_constant_result
def _spec(constants: tuple[Any, ...]) -> str:
    """Run for real while Dynamo traces (its result is a constant of the graph)."""
    return json.dumps({"source": _traced_call_site(), "values": constants})


@torch.library.custom_op("obs::print_values", mutates_args=())
def print_values(tensors: list[torch.Tensor], spec: str) -> None:
    """Publish one Print call: ``spec`` lists the values, ``null`` marking the next tensor."""
    it = iter(tensors)
    call = json.loads(spec)
    values = tuple(next(it) if v is None else v for v in call["values"])
    demands.print_sink(values, call["source"])  # the eager Print path, resolved at run time (never traced)


@print_values.register_fake
def _(tensors: list[torch.Tensor], spec: str) -> None:
    return None


def print_in_graph(values: tuple[Any, ...]) -> None:
    """Called while Dynamo traces ``obs.Print``: emits the custom op into the graph."""
    flat = _flatten(values, [])
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    constants = tuple(None if isinstance(v, torch.Tensor) else v for v in flat)
    torch.ops.obs.print_values(tensors, _spec(constants))


if hasattr(torch.fx.node, "has_side_effect"):
    torch.fx.node.has_side_effect(torch.ops.obs.print_values.default)

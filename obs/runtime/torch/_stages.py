"""The graphs after AOT autograd, published as GRAPH_COMPILED with their stage (``save_graphs`` >= 2).

:func:`staged` wraps the inner backend of ``obs.compile`` so that each graph AOT autograd produces
(forward, backward, inference; the joint graph before partitioning when ``joint``) is published
before it is compiled, carrying ``meta['obs_stage']`` and a link to the Dynamo graph it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from obs._core.events import Event, bus
from obs._core.internal import suppressed

__all__ = ["staged"]


def _publish(name: str, stage: str, gm: torch.fx.GraphModule, inputs: Any, parent: torch.fx.GraphModule) -> None:
    gm.meta.update(obs_stage=stage, obs_root=parent.meta.get("obs_root"), obs_parent=parent,
                   obs_backend=parent.meta.get("obs_backend"), obs_classes=parent.meta.get("obs_classes"))
    with suppressed():
        bus.emit(Event.GRAPH_COMPILED, name, gm, inputs)


def _capturing(compiler: Callable[..., Any], stage: str, name: str, parent: torch.fx.GraphModule) -> Callable[..., Any]:
    def compile_stage(gm: torch.fx.GraphModule, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        _publish(name, stage, gm, inputs, parent)
        return compiler(gm, inputs, *args, **kwargs)

    return compile_stage


def _joint(partition: Callable[..., Any], name: str, parent: torch.fx.GraphModule) -> Callable[..., Any]:
    def partition_fn(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        _publish(name, "aot_joint", joint, inputs, parent)
        return partition(joint, inputs, **kwargs)

    return partition_fn


def staged(inner: str | Callable[..., Any], name: str, parent: torch.fx.GraphModule, *,
           joint: bool = False) -> Callable[..., Any]:
    """A backend doing what ``inner`` does while publishing the graphs after AOT autograd."""
    from functorch.compile import default_partition, make_boxed_func
    from torch._dynamo import lookup_backend
    from torch._dynamo.backends.common import AotAutograd, aot_autograd

    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(gm: torch.fx.GraphModule, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            stage = "aot_backward" if kwargs.get("is_backward") else \
                "aot_inference" if kwargs.get("is_inference") else "aot_forward"
            _publish(name, stage, gm, inputs, parent)
            return compile_fx_inner(gm, inputs, *args, **kwargs)

        def inductor(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            from torch._functorch import config as functorch_config

            # A hit in AOT autograd's cache would skip inner_compile, and with it the graphs to publish.
            with functorch_config.patch(enable_autograd_cache=False):
                return compile_fx(gm, inputs, inner_compile=inner_compile)

        return inductor
    backend = lookup_backend(inner) if isinstance(inner, str) else inner
    if inner == "aot_eager":  # a function building its AotAutograd per call: the same one, with our compilers
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        backend = AotAutograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                              partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)
    if isinstance(backend, AotAutograd):
        kwargs = dict(backend.kwargs)
        forward = kwargs["fw_compiler"]
        kwargs["fw_compiler"] = _capturing(forward, "aot_forward", name, parent)
        kwargs["bw_compiler"] = _capturing(kwargs.get("bw_compiler") or forward, "aot_backward", name, parent)
        kwargs["inference_compiler"] = _capturing(kwargs.get("inference_compiler") or forward, "aot_inference",
                                                  name, parent)
    else:  # not AOT-based: AOT autograd first, then the backend compiles each graph
        def boxed(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            return make_boxed_func(backend(gm, inputs))

        kwargs = {"fw_compiler": _capturing(boxed, "aot_forward", name, parent),
                  "bw_compiler": _capturing(boxed, "aot_backward", name, parent),
                  "inference_compiler": _capturing(boxed, "aot_inference", name, parent)}
    if joint:
        kwargs["partition_fn"] = _joint(kwargs.get("partition_fn") or default_partition, name, parent)
    return aot_autograd(**kwargs)

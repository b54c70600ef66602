"""DDP's gradient-bucket all_reduces, which its C++ reducer issues behind the Python collectives, on record.

Where PyTorch's Flight Recorder records the model's process group (torch 2.13 does for gloo unless
``TORCH_FR_BUFFER_SIZE=0``; obs sets the size before the first group is made), the buckets are taken from it at
dump time (:mod:`obs.runtime.torch._flight_recorder`): DDP reduces in C++ as without obs, and nothing runs per
bucket.  Otherwise (an older torch, the Flight Recorder turned off) the model gets one Python communication
hook, a relay, and the log says so once: by default it does what PyTorch's own ``allreduce_hook`` does (divide
by the group size, all_reduce: what the reducer does with no hook, the same numbers) and records the all_reduce
(:meth:`CollectiveHooks.bucket_all_reduce`).

The reducer takes one hook per model, once.  So a hook the user registers later
(``register_comm_hook``, or a built-in one) replaces the relay's default instead of failing: the
relay calls the user's hook (whose Python collectives are recorded as any others).  A model that
already has a hook when it is built (DDP's mixed-precision hook), or reduces in Python (compiled
autograd), is left alone.  ``remove()`` puts the class back; models built meanwhile keep their relay,
which then only calls PyTorch's ``allreduce_hook``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from obs._core.internal import report_internal_error
from obs.runtime.torch import _flight_recorder

__all__ = ["DdpHooks"]


class _Relay:
    """The hook DDP calls per bucket: the user's hook if they registered one, else the default all_reduce.

    While obs records, the default is ``record(buffer, group)``: PyTorch's allreduce_hook (divide by
    the group size, all_reduce) with its record published from the future's own callback (one
    Python callback per bucket, as allreduce_hook has); afterwards PyTorch's allreduce_hook itself."""

    __slots__ = ("hook", "state", "taken", "record", "__weakref__")

    def __init__(self, process_group: Any, record: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.hook, self.state, self.record = allreduce_hook, process_group, record
        self.taken = False  #: the user registered a hook (a second one fails in the reducer, as without obs)

    def take(self, hook: Any, state: Any) -> None:
        self.hook, self.state, self.taken = hook, state, True

    def __call__(self, _state: Any, bucket: Any) -> Any:
        record = self.record
        if record is not None and not self.taken:
            return record(bucket.buffer(), self.state)
        return self.hook(self.state, bucket)


class DdpHooks:
    """Patches ``DistributedDataParallel`` (construction and hook registration) until ``remove()``."""

    #: take the buckets from the Flight Recorder where it records the model's group (False: always the relay)
    use_flight_recorder = True

    def __init__(self, record: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self._cls = DDP
        self._relays: weakref.WeakSet[_Relay] = weakref.WeakSet()
        self._saved = {name: DDP.__dict__[name] for name in ("__init__", "register_comm_hook",
                                                             "_register_builtin_comm_hook")}
        init, register, builtin = (self._saved[n] for n in ("__init__", "register_comm_hook",
                                                           "_register_builtin_comm_hook"))

        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - becomes DDP.__init__
            init(ddp, *args, **kwargs)
            try:
                if self.use_flight_recorder and _flight_recorder.records(ddp.process_group):
                    _flight_recorder.say_once("fr", logging.INFO, "obs: DDP's gradient buckets are taken from "
                                              "PyTorch's Flight Recorder at dump time (no communication hook)")
                    return
                relay = _install_relay(ddp, record)
                if relay is not None:
                    self._relays.add(relay)
                    _flight_recorder.say_once("relay", logging.WARNING, "obs: PyTorch's Flight Recorder does not "
                                              "record this DDP model's process group (TORCH_FR_BUFFER_SIZE=0, or "
                                              "an older torch): its gradient buckets are recorded through a "
                                              "Python communication hook (about 0.1-0.2 ms per bucket)")
            except Exception as exc:  # noqa: BLE001 - our bug: the model trains without its buckets on record
                report_internal_error("DDP communication hook", exc)

        def register_comm_hook(ddp: Any, state: object, hook: Any) -> None:
            relay = ddp.__dict__.get("_obs_relay")
            if relay is None or relay.taken:
                return register(ddp, state, hook)
            ddp._check_comm_hook(hook)
            ddp.logger._set_comm_hook_name(hook.__qualname__)
            ddp._comm_hooks.append((hook, state))
            relay.take(hook, state)
            return None

        def _register_builtin_comm_hook(ddp: Any, comm_hook_type: Any) -> None:
            relay = ddp.__dict__.get("_obs_relay")
            if relay is None or relay.taken:
                return builtin(ddp, comm_hook_type)
            ddp.logger._set_comm_hook_name(str(comm_hook_type))
            relay.take(_builtin(comm_hook_type), ddp.process_group)
            return None

        __init__.__wrapped__ = init  # type: ignore[attr-defined]
        DDP.__init__ = __init__  # type: ignore[method-assign]
        DDP.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
        DDP._register_builtin_comm_hook = _register_builtin_comm_hook  # type: ignore[method-assign]

    def remove(self) -> None:
        for name, original in self._saved.items():
            setattr(self._cls, name, original)
        self._saved = {}
        for relay in list(self._relays):  # models built meanwhile go on with PyTorch's allreduce_hook
            relay.record = None


def _install_relay(ddp: Any, record: Any) -> _Relay | None:
    import torch.distributed as dist

    reducer = getattr(ddp, "reducer", None)
    if reducer is None or ddp._comm_hooks or getattr(ddp, "_use_python_reducer", False):
        return None
    relay = _Relay(ddp.process_group, record)
    dist._register_comm_hook(reducer, None, relay)
    ddp._obs_relay = relay
    return relay


def _builtin(comm_hook_type: Any) -> Any:
    """The Python twin of a C++ built-in hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return default_hooks.allreduce_hook

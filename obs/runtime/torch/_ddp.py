"""DDP's gradient-bucket all_reduces, which its C++ reducer issues behind the Python collectives, on record.

While obs records collectives, a model built then gets one Python communication hook, a relay: it reduces each
bucket as DDP's reducer does without a hook (:func:`scale`, then all_reduce: the same bits) and records the
all_reduce in the ring as it is issued (:meth:`CollectiveHooks.bucket_all_reduce`), so a live view (``obs top``)
lines the ranks up at DDP's first sync of the step: a rank slow in its data loading shows there.  A model whose
reducer scales in a way a hook cannot repeat (``gradient_as_bucket_view=True``: it divides a gradient that already
is its bucket's view) keeps DDP's C++ reduction where PyTorch's Flight Recorder records its group (torch 2.13 does
for gloo unless ``TORCH_FR_BUFFER_SIZE=0``; obs sets the size before the first group is made): its buckets are
taken from it at dump time (:mod:`obs.runtime.torch._flight_recorder`), and the log says so once.

The reducer takes one hook per model, once.  So a hook the user registers later
(``register_comm_hook``, or a built-in one) replaces the relay's default instead of failing: the
relay calls the user's hook (whose Python collectives are recorded as any others).  A model that
already has a hook when it is built (DDP's mixed-precision hook), or reduces in Python (compiled
autograd), is left alone.  ``remove()`` puts the class back; models built meanwhile keep their relay,
which then reduces without recording.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from obs._core.internal import report_internal_error
from obs.runtime.torch import _flight_recorder

__all__ = ["DdpHooks", "reduce", "scale"]


def scale(buffer: Any, size: int) -> None:
    """Divide a bucket by the group's size as DDP's reducer does without a hook: a dense gradient is multiplied by
    the reciprocal as it is copied into its bucket (the same product here, after the copy: the same bits; PyTorch's
    ``allreduce_hook`` divides, which differs in the last bit where the size is not a power of two), a sparse one
    divided."""
    if buffer.is_sparse:
        buffer.div_(size)
    else:
        buffer.mul_(1.0 / size)


def reduce(buffer: Any, group: Any) -> Any:
    """A bucket reduced as DDP's reducer does without a hook, off record: the future DDP waits for."""
    scale(buffer, group.size())
    return group.allreduce([buffer]).get_future().then(_first)


def _first(future: Any) -> Any:
    return future.value()[0]


class _Relay:
    """The hook DDP calls per bucket: the user's hook if they registered one, else the bucket's reduction.

    While obs records, ``record(buffer, group)`` reduces it on record (one Python call and one future callback per
    bucket, as PyTorch's ``allreduce_hook`` has); afterwards :func:`reduce`."""

    __slots__ = ("hook", "state", "taken", "record", "__weakref__")

    def __init__(self, process_group: Any, record: Any) -> None:
        self.hook: Any = None
        self.state, self.record = process_group, record
        self.taken = False  #: the user registered a hook (a second one fails in the reducer, as without obs)

    def take(self, hook: Any, state: Any) -> None:
        self.hook, self.state, self.taken = hook, state, True

    def __call__(self, _state: Any, bucket: Any) -> Any:
        if self.taken:
            return self.hook(self.state, bucket)
        record = self.record
        if record is not None:
            return record(bucket.buffer(), self.state)
        return reduce(bucket.buffer(), self.state)


class DdpHooks:
    """Patches ``DistributedDataParallel`` (construction and hook registration) until ``remove()``."""

    #: record each bucket's all_reduce as it is issued, through the relay (False: take the buckets from the Flight
    #: Recorder at dump time where it records the model's group, as a model the relay cannot reduce exactly does)
    live = True

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
                recorded = _flight_recorder.records(ddp.process_group)
                if recorded and not (self.live and _exact(ddp)):
                    _flight_recorder.say_once("fr", logging.INFO, "obs: this DDP model's gradient buckets are taken "
                                              "from PyTorch's Flight Recorder at dump time (no communication hook; "
                                              "obs top does not see them while the job runs)")
                    return
                relay = _install_relay(ddp, record)
                if relay is not None:
                    self._relays.add(relay)
                    if not recorded:
                        _flight_recorder.say_once("relay", logging.WARNING, "obs: PyTorch's Flight Recorder does not "
                                                  "record this DDP model's process group (TORCH_FR_BUFFER_SIZE=0, or "
                                                  "an older torch): its gradient buckets are recorded through a "
                                                  "Python communication hook only")
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
        for relay in list(self._relays):  # models built meanwhile go on reducing, off record
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


def _exact(ddp: Any) -> bool:
    """Whether the relay reduces this model's buckets to DDP's own bits: not where a gradient is its bucket's view
    (the reducer then divides it in place, where a hook sees the bucket only after the gradient was accumulated)."""
    return not getattr(ddp, "gradient_as_bucket_view", False)


def _builtin(comm_hook_type: Any) -> Any:
    """The Python twin of a C++ built-in hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return default_hooks.allreduce_hook

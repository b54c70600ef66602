"""What the monitor collects on the training thread: its optimizer, backward and module hooks.

At every collected optimizer step, with no ``.item()`` and no host read of a GPU tensor on the training thread:

* before ``optimizer.step()``: each gradient's norm, each parameter's (or its sample's) norm, and a copy of the
  samples; after it, the norm of their change (:mod:`obs.features.monitor.norms`: one native pass per list on the
  CPU, fused ops elsewhere).  The update/weight ratio and the global gradient norm are computed from these norms by
  the worker thread;
* the loss: the value given to ``obs.scalar("loss", ...)``, else the one-element tensor ``backward()`` started from
  (``backward()``'s wrapper also gives the step a loss given later belongs to);
* opt-in: every statistic of ``ops`` of gradients (``wg_distribution``), updates (``ur_distribution``), Adam's
  moments (``mv_distribution``) and, through forward hooks on the chosen modules, activations (``xy_distribution``).

The step's values are handed to the worker thread (:mod:`obs.features.monitor.writer`) as one packet; on CUDA its
tensors travel as one device batch in one pinned copy with an event (:mod:`obs.features.monitor.batch`), which the
worker waits for.  Nothing here changes what the model computes: every op runs under ``torch.no_grad()`` on the
hooks' own tensors, with obs's other hooks suppressed.

Parameter names come from the model, found at the first optimizer step among the locals and globals of the frames
that called it (:mod:`obs.features.monitor.names`); with activations on, from the first module called (the model),
through a global forward pre-hook installed only until then.  Steps count optimizer steps from 0, as msprobe does.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from obs._core.internal import report_internal_error, suppressed
from obs.features.monitor.activations import Activations
from obs.features.monitor.batch import to_host
from obs.features.monitor.layout import VALUE_OPS
from obs.features.monitor.names import clean, find_model, hush_compile_hook_warning, matches, unhush
from obs.features.monitor.norms import ParamNorms
from obs.features.monitor.stats import NORM, shape_of, stats, stats_all
from obs.features.monitor.writer import Block, Packet, Worker
from obs.features.profiling import scalars
from obs.runtime.torch import AutogradCall

__all__ = ["Collector", "Plan", "process_meta", "run_stamp"]

_LOSS_BLOCK = Block("_loss", (("loss", None, "", ""),), ("value",))


@dataclass(frozen=True)
class Plan:
    """What to collect (the monitor's settings in force, resolved)."""

    ops: tuple[str, ...] = ("norm",)
    eps: float = 1e-8
    targets: tuple[str, ...] = ("",)  #: parameter and module name prefixes or patterns; "" is every one
    xy: bool = False
    all_xy: bool = False
    wg: bool = False
    mv: bool = False
    ur: bool = False
    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100_000_000
    print_struct: bool = False
    update_sample: int = 4096  #: 0: exact update norms

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 0) is collected."""
        since = step - self.start_step
        return since >= 0 and since % self.step_interval == 0 and since // self.step_interval < self.collect_times

    @property
    def value_ops(self) -> tuple[str, ...]:
        return tuple(op for op in self.ops if op in VALUE_OPS) or NORM


class _Watched:
    """One optimizer's parameters with a gradient, as of a step: those watched, their rows, norms and blocks."""

    __slots__ = ("params", "rows", "norms", "blocks")

    def __init__(self, params: list[torch.Tensor], rows: tuple[tuple[str, int | None, str, str], ...],
                 norms: ParamNorms) -> None:
        self.params, self.rows, self.norms = params, rows, norms
        # sampled: the ratio is the samples' norms' ratio; the worker scales the update's norm to the whole
        self.blocks = [Block("_gnorm", rows, NORM), Block("_unorm", rows, NORM, norms.scales),
                       Block("_wnorm", rows, NORM)]


class _Opt:
    """One optimizer's step count and its watched parameters, by the ids of its parameters with a gradient."""

    __slots__ = ("step", "pending", "watched", "__weakref__")

    def __init__(self) -> None:
        self.step = 0
        self.pending: Any = None
        self.watched: dict[tuple[int, ...], _Watched] = {}


class Collector:
    """The hooks of one monitor run; :meth:`remove` takes them all out."""

    def __init__(self, plan: Plan, worker: Worker, meta: Mapping[str, Any]) -> None:
        self.plan, self.worker, self.meta = plan, worker, dict(meta)
        self._opts: weakref.WeakKeyDictionary[Any, _Opt] = weakref.WeakKeyDictionary()
        self._names: dict[int, str] = {}  # id(parameter) -> its name under the model
        self._modules: list[str] = []  # the model's modules, in named_modules order
        self._params: list[str] = []
        self._roots: list[torch.Tensor] = []  # backward()'s one-element roots since the last step
        self._backward_step = 0
        self._step_now = 0  # the first optimizer's step count: the step of forward and backward work
        self._scalar_loss = False
        self._acts = Activations(plan.value_ops, plan.eps, struct=plan.print_struct)
        self._acts.due = plan.due(0)
        self._handles: list[Any] = []
        self._module_hooks: list[Any] = []
        self._hooked: set[int] = set()
        self._discover_handle: Any = None
        self._hushed: Any = None  # the warnings filter kept while the discovery hook is in place
        self._backward: AutogradCall | None = None
        self._meta_sent: tuple[int, int] = (-1, -1)
        #: more blocks of each step: callables (optimizer, step) -> (Block, tensor) or None (unreduced.py)
        self.extras: list[Any] = []
        self._first: weakref.ref[_Opt] | None = None  # the first optimizer's state: its steps are the run's
        self._last: tuple[weakref.ref[Any], _Opt] | None = None  # the last optimizer seen, and its state
        self._torch_work = plan.wg or plan.ur or plan.mv  # torch ops in the hooks beyond the norms' own

    # -- install / remove ---------------------------------------------------------------------------
    def install(self) -> Collector:
        self._handles = [torch_optimizer.register_optimizer_step_pre_hook(self._pre),
                         torch_optimizer.register_optimizer_step_post_hook(self._post)]
        self._backward = AutogradCall(torch.autograd, "backward", on_start=self._root)
        if self.plan.xy or self.plan.print_struct:  # activations from the first forward on: hooks before it
            self._discover_handle = torch.nn.modules.module.register_module_forward_pre_hook(self._discover)
            self._hushed = hush_compile_hook_warning()
        scalars.set_tap(self._scalar)
        return self

    def remove(self) -> None:
        scalars.set_tap(None)
        for handle in [*self._handles, *self._module_hooks]:
            handle.remove()
        self._handles, self._module_hooks = [], []
        if self._discover_handle is not None:
            self._discover_handle.remove()
            self._discover_handle = None
        unhush(self._hushed)
        if self._backward is not None:
            self._backward.unwrap()
            self._backward = None

    # -- names -------------------------------------------------------------------------------------------
    def _discover(self, module: torch.nn.Module, args: Any) -> None:
        """The first module called is the model: its names of parameters and modules; then this hook goes."""
        try:
            handle, self._discover_handle = self._discover_handle, None
            if handle is not None:
                handle.remove()
                unhush(self._hushed)
            self._learn(module)
        except Exception as exc:  # noqa: BLE001 - reported; never raised into the forward
            report_internal_error("monitor: module names", exc)

    def _learn(self, root: torch.nn.Module) -> None:
        for name, param in root.named_parameters():
            self._names.setdefault(id(param), clean(name))
        modules = [(clean(name), m) for name, m in root.named_modules()]
        self._modules = [name for name, _ in modules]
        plan, struct = self.plan, self._acts.struct is not None
        if plan.xy or struct:
            from obs.features.monitor import compiled  # a compiled model: its graphs tap activations, no hook

            taps = compiled.take_over(self, root, lambda n: plan.all_xy or matches(n, plan.targets, modules=True),
                                      lambda t: stats(t, plan.value_ops, plan.eps))
            if taps is not None:
                self._module_hooks.append(taps)
                return
            for name, module in modules:
                if id(module) in self._hooked:  # a model learnt twice (a second optimizer's): hooked once
                    continue
                watched = plan.xy and (plan.all_xy or matches(name, plan.targets, modules=True))
                if struct or watched:
                    self._hooked.add(id(module))
                    self._module_hooks.append(module.register_forward_hook(self._acts.hook(name, watched)))

    # -- backward and obs.scalar: the loss -----------------------------------------------------------------
    def _root(self, roots: Any) -> None:
        self._backward_step = self._step_now
        if not self._scalar_loss and isinstance(roots, torch.Tensor) and roots.numel() == 1:
            self._roots.append(roots.detach())

    def _scalar(self, name: str, value: Any) -> None:
        if name != "loss":
            return
        try:
            step = self._backward_step
            if not self.plan.due(step):
                return
            self._scalar_loss = True
            self._roots.clear()
            if isinstance(value, torch.Tensor):
                value = value.detach().reshape(-1)[0] if value.numel() else math.nan
                if value.device.type == "cpu":
                    value = float(value)  # in host memory: nothing to wait for
            self.worker.submit(("loss", step, value))
        except Exception as exc:  # noqa: BLE001 - reported; obs.scalar never raises for the monitor
            report_internal_error("monitor: loss", exc)

    # -- the optimizer step -------------------------------------------------------------------------------
    def _pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        state = self._state(opt)
        state.pending = None
        if not self.plan.due(state.step):
            return
        try:
            if self._torch_work:
                with torch.no_grad(), suppressed():
                    state.pending = self._before(state, opt)
            else:  # the norms guard their own torch ops (none on the CPU's native path)
                state.pending = self._before(state, opt)
        except Exception as exc:  # noqa: BLE001 - reported; the optimizer step goes on
            report_internal_error("monitor: before the optimizer step", exc)

    def _state(self, opt: Any) -> _Opt:
        last = self._last
        if last is not None and last[0]() is opt:  # one optimizer: no weak dictionary look-up per step
            return last[1]
        state = self._opts.get(opt)
        if state is None:
            state = self._opts[opt] = _Opt()
            if self._first is None:
                self._first = weakref.ref(state)
        self._last = (weakref.ref(opt), state)
        return state

    def _before(self, state: _Opt, opt: Any) -> Any:
        plan = self.plan
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        key = tuple(map(id, params))
        watched = state.watched.get(key)
        if watched is None:
            watched = state.watched[key] = self._watch(params)
        if not watched.params:
            return None
        grads = [p.grad for p in watched.params]
        pending = watched.norms.before(grads)
        extra: list[tuple[Block, torch.Tensor]] = []
        if plan.wg:
            extra.append((Block("grad_reduced", watched.rows, plan.value_ops), stats_all(grads, plan.value_ops,
                                                                                        plan.eps)))
        return watched, pending, extra

    def _watch(self, params: list[torch.Tensor]) -> _Watched:
        """The parameters of a new list that are watched (named first: targets match names), their rows and norms."""
        if any(id(p) not in self._names for p in params):
            model = find_model(params, depth=3)  # the frames from _pre's up
            if model is not None:
                self._learn(model)
        plan, index = self.plan, {id(p): i for i, p in enumerate(params)}
        chosen = [p for p in params if not p.grad.is_sparse and matches(self._names.get(id(p), ""), plan.targets)]
        rows = tuple((self._names.get(id(p)) or f"param_{index[id(p)]}", None, shape_of(p), str(p.dtype))
                     for p in chosen)
        if rows:
            self._params = [r[0] for r in rows]
        # with ur_distribution the updates are exact, and their statistics need them as tensors
        return _Watched(chosen, rows, ParamNorms(chosen, 0 if plan.ur else plan.update_sample, native=not plan.ur))

    def _post(self, opt: Any, args: Any, kwargs: Any) -> None:
        state = self._state(opt)
        step, pending, state.pending = state.step, state.pending, None
        state.step += 1
        if self._first is not None and state is self._first():
            self._step_now = state.step
        self._acts.due = self.plan.due(self._step_now)
        if pending is None:
            self._roots.clear()
            self._acts.clear()
            return
        try:
            if self._torch_work:
                with torch.no_grad(), suppressed():
                    self._after(step, opt, pending)
            else:
                self._after(step, opt, pending)
        except Exception as exc:  # noqa: BLE001 - reported; the training loop goes on
            report_internal_error("monitor: after the optimizer step", exc)

    def _after(self, step: int, opt: Any, pending: Any) -> None:
        plan = self.plan
        watched, before, extra = pending
        blocks: list[Block] = []
        values: list[Any] = []
        actv = self._acts.take(plan.value_ops)
        if actv is not None:
            blocks.append(actv[0])
            values += actv[1]
        for block, tensor in extra:
            blocks.append(block)
            values.append(tensor)
        for more in self.extras:
            got = more(opt, step)
            if got is not None:
                blocks.append(got[0])
                values.append(got[1])
        blocks += watched.blocks
        values.append(watched.norms.after(before))
        if plan.ur:
            updates = watched.norms.updates(before)
            torch._foreach_neg_(updates)
            blocks.append(Block("param_update", watched.rows, plan.value_ops))
            values.append(stats_all(updates, plan.value_ops, plan.eps))
        if plan.mv:
            self._moments(opt, watched, blocks, values)
        if self._roots:
            blocks.append(_LOSS_BLOCK)
            roots = self._roots
            if len(roots) == 1:
                values.append(roots[0])
            else:
                with torch.no_grad(), suppressed():
                    values.append(torch.stack(roots).float().mean())
            self._roots = []
        if self._acts.struct is not None:
            self.worker.submit(("struct", self._acts.struct))
            self._acts.struct = None
        self._send_meta()
        self.worker.submit(Packet(step, blocks, to_host(values)))

    def _moments(self, opt: Any, watched: _Watched, blocks: list[Block], values: list[Any]) -> None:
        ops, eps = self.plan.value_ops, self.plan.eps
        for key in ("exp_avg", "exp_avg_sq"):
            found = [(row, opt.state[p][key]) for p, row in zip(watched.params, watched.rows)
                     if isinstance(opt.state.get(p, {}).get(key), torch.Tensor)]
            if found:
                blocks.append(Block(key, tuple(r for r, _ in found), ops))
                values.append(stats_all([t for _, t in found], ops, eps))

    def _send_meta(self) -> None:
        sizes = (len(self._modules), len(self._params))
        if sizes == self._meta_sent:
            return
        self._meta_sent = sizes
        self.worker.submit(("meta", {**self.meta, "modules": list(self._modules), "params": list(self._params)}))


def run_stamp() -> str:
    """msprobe's run folder time tag (``Nov29_14-03-59``), local time."""
    return time.strftime("%b%d_%H-%M-%S")


def process_meta(rank: int, world_size: int) -> dict[str, Any]:
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "started": time.time()}

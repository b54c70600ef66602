"""What the monitor collects on the training thread: its optimizer, backward and module hooks.

At every collected optimizer step, with fused ops (``torch._foreach_norm``, one kernel per group of tensors rather
than one per tensor), no ``.item()`` and no host read on the training thread:

* before ``optimizer.step()``: each gradient's norm, each parameter's norm, and a copy of the parameters into
  buffers kept from step to step (``torch._foreach_copy_``);
* after it: the change of each parameter (``torch._foreach_sub_``) and its norm.  The update/weight ratio and the
  global gradient norm are computed from these norms by the worker thread.  A parameter of more than
  ``update_sample`` elements takes part in the update norm and ratio through a fixed strided sample of them
  (scaled to the whole): the copy and the difference then cost no more than that per parameter, where an exact
  update costs a copy of every parameter at every step (``update_sample: 0``);
* the loss: the value given to ``obs.scalar("loss", ...)``, else the one-element tensor ``backward()`` started from;
* opt-in: every statistic of ``ops`` of gradients (``wg_distribution``), updates (``ur_distribution``), Adam's
  moments (``mv_distribution``) and, through forward hooks on the chosen modules, activations (``xy_distribution``).

The step's values stay in a few tensors handed to the worker thread (:mod:`obs.features.monitor.writer`), which
reads them (one host read per step, off the training thread; on CUDA the training thread never waits for the
device).  Nothing here changes what the model computes: every op runs under ``torch.no_grad()`` on the hooks'
own tensors, with obs's other hooks suppressed.

Parameter names come from the model, found at the first optimizer step among the locals and globals of the frames
that called it (no global module hook: ``torch.compile`` warns about those); with activations on, from the first
module called (the model), through a global forward pre-hook installed only until then.  Steps count optimizer steps
from 0, as msprobe does.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from obs._core.internal import report_internal_error, suppressed
from obs.features.monitor.layout import VALUE_OPS
from obs.features.monitor.writer import Block, Packet, Worker
from obs.features.profiling import scalars
from obs.runtime.torch import AutogradCall

__all__ = ["Collector", "Plan"]

_NORM = ("norm",)


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
        return tuple(op for op in self.ops if op in VALUE_OPS) or _NORM


class _Opt:
    """One optimizer's step count and the buffers of its parameters' values before the step."""

    __slots__ = ("step", "buffers", "pending", "rows", "samples", "__weakref__")

    def __init__(self) -> None:
        self.step = 0
        self.buffers: dict[int, torch.Tensor] = {}
        self.pending: Any = None
        self.rows: dict[tuple[int, ...], tuple[tuple[str, int | None, str, str], ...]] = {}
        self.samples: dict[tuple[int, ...], tuple[list[torch.Tensor], tuple[float, ...]]] = {}


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
        self._actv_rows: list[tuple[str, int | None, str, str]] = []
        self._actv_values: list[torch.Tensor] = []
        self._calls: dict[str, int] = {}
        self._struct: dict[str, dict[str, Any]] | None = {} if plan.print_struct else None
        self._handles: list[Any] = []
        self._module_hooks: list[Any] = []
        self._hooked: set[int] = set()
        self._discover_handle: Any = None
        self._backward: AutogradCall | None = None
        self._meta_sent: tuple[int, int] = (-1, -1)
        #: more blocks of each step: callables (optimizer, step) -> (Block, tensor) or None (unreduced.py)
        self.extras: list[Any] = []

    # -- install / remove ---------------------------------------------------------------------------
    def install(self) -> Collector:
        self._handles = [torch_optimizer.register_optimizer_step_pre_hook(self._pre),
                         torch_optimizer.register_optimizer_step_post_hook(self._post)]
        self._backward = AutogradCall(torch.autograd, "backward", on_start=self._root)
        if self.plan.xy or self.plan.print_struct:  # activations from the first forward on: hooks before it
            self._discover_handle = torch.nn.modules.module.register_module_forward_pre_hook(self._discover)
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
            self._learn(module)
        except Exception as exc:  # noqa: BLE001 - reported; never raised into the forward
            report_internal_error("monitor: module names", exc)

    def _find_model(self, params: list[torch.Tensor]) -> None:
        """The model of an optimizer's parameters, from the frames that called ``optimizer.step()`` (their locals and
        globals, and one level of attributes: ``self.model``): the module holding most of them, the largest on a
        tie.  No global module hook, so ``torch.compile`` sees none (it warns when there is one)."""
        want = {id(p) for p in params}
        best: tuple[int, int, Any] = (0, 0, None)
        seen: set[int] = set()
        frame = sys._getframe(1)
        for _ in range(40):
            if frame is None:
                break
            for scope in (frame.f_locals, frame.f_globals):
                for value in list(scope.values()):
                    for module in _modules_in(value):
                        if id(module) in seen:
                            continue
                        seen.add(id(module))
                        mine = [id(p) for p in module.parameters()]
                        got = (sum(1 for i in mine if i in want), len(mine), module)
                        if got[:2] > best[:2]:
                            best = got
            frame = frame.f_back
        if best[2] is not None:
            self._learn(best[2])

    def _learn(self, root: torch.nn.Module) -> None:
        for name, param in root.named_parameters():
            self._names.setdefault(id(param), _clean(name))
        modules = [(_clean(name), m) for name, m in root.named_modules()]
        self._modules = [name for name, _ in modules]
        if self.plan.xy or self._struct is not None:
            from obs.features.monitor import compiled  # a compiled model: its graphs tap activations, no hook

            plan = self.plan
            taps = compiled.take_over(self, root, lambda n: plan.all_xy or _matches(n, plan.targets, modules=True),
                                      lambda t: _stats(t, plan.value_ops, plan.eps))
            if taps is not None:
                self._module_hooks.append(taps)
                return
            for name, module in modules:
                if id(module) in self._hooked:  # a model learnt twice (a second optimizer's): hooked once
                    continue
                if self._struct is not None or self.plan.all_xy or _matches(name, self.plan.targets, modules=True):
                    self._hooked.add(id(module))
                    self._module_hooks.append(module.register_forward_hook(self._make_xy(name)))

    # -- forward: activations ----------------------------------------------------------------------------
    def _make_xy(self, name: str) -> Any:
        plan, me = self.plan, self
        watched = plan.xy and (plan.all_xy or _matches(name, plan.targets, modules=True))

        def hook(mod: Any, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or not mod.training:
                return
            try:
                with torch.no_grad(), suppressed():
                    if me._struct is not None and name not in me._struct:
                        me._struct[name] = {"input": _struct_of(args), "output": _struct_of(output)}
                    if watched and plan.due(me._current_step()):
                        me._activations(name, args, output)
            except Exception as exc:  # noqa: BLE001 - reported; never raised into the forward
                report_internal_error("monitor: activations", exc)

        return hook

    def _activations(self, name: str, args: Any, output: Any) -> None:
        micro = self._calls.get(name, 0)
        self._calls[name] = micro + 1
        ops, eps = self.plan.value_ops, self.plan.eps
        for label, value in (("input", args), ("output", output)):
            tensors = _tensors(value)
            for i, t in enumerate(tensors):
                row = f"{name}.{label}" if len(tensors) == 1 else f"{name}.{label}_{i}"
                self._actv_rows.append((row, micro, _shape(t), str(t.dtype)))
                self._actv_values.append(_stats(t, ops, eps))

    # -- backward and obs.scalar: the loss -----------------------------------------------------------------
    def _root(self, roots: Any) -> None:
        self._backward_step = self._current_step()
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

    def _current_step(self) -> int:
        return self._step_now

    # -- the optimizer step -------------------------------------------------------------------------------
    def _pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        state = self._opts.get(opt)
        if state is None:
            state = self._opts[opt] = _Opt()
        state.pending = None
        if not self.plan.due(state.step):
            return
        try:
            with torch.no_grad(), suppressed():
                state.pending = self._before(state, opt)
        except Exception as exc:  # noqa: BLE001 - reported; the optimizer step goes on
            report_internal_error("monitor: before the optimizer step", exc)

    def _before(self, state: _Opt, opt: Any) -> Any:
        plan = self.plan
        params = [p for group in opt.param_groups for p in group["params"]
                  if p.grad is not None and not p.grad.is_sparse and _matches(self._names.get(id(p), ""), plan.targets)]
        if not params:
            return None
        key = tuple(map(id, params))
        rows = state.rows.get(key)
        if rows is None:
            if any(id(p) not in self._names for p in params):
                self._find_model(params)
            rows = state.rows[key] = tuple((self._name(p, i), None, _shape(p), str(p.dtype))
                                           for i, p in enumerate(params))
            self._params = [r[0] for r in rows]
        grads = [p.grad for p in params]
        grad_norms = torch._foreach_norm(grads)
        sample = 0 if plan.ur else plan.update_sample
        views, scale = self._samples(state, params, key, sample) if sample else (params, None)
        weight_norms = torch._foreach_norm(views)
        buffers = [self._buffer(state, v, p) for v, p in zip(views, params)]
        torch._foreach_copy_(buffers, views)
        extra: list[tuple[Block, torch.Tensor]] = []
        if plan.wg:
            extra.append((Block("grad_reduced", rows, plan.value_ops), _stats_all(grads, plan.value_ops, plan.eps)))
        return views, rows, grad_norms, weight_norms, buffers, extra, scale

    def _post(self, opt: Any, args: Any, kwargs: Any) -> None:
        state = self._opts.get(opt)
        if state is None:
            return
        step, pending, state.pending = state.step, state.pending, None
        state.step += 1
        if state is next(iter(self._opts.values()), None):
            self._step_now = state.step
        if pending is None:
            self._roots.clear()
            self._actv_rows, self._actv_values, self._calls = [], [], {}
            return
        try:
            with torch.no_grad(), suppressed():
                self._after(step, opt, pending)
        except Exception as exc:  # noqa: BLE001 - reported; the training loop goes on
            report_internal_error("monitor: after the optimizer step", exc)

    def _after(self, step: int, opt: Any, pending: Any) -> None:
        plan = self.plan
        params, rows, grad_norms, weight_norms, buffers, extra, scale = pending
        torch._foreach_sub_(buffers, params)  # the value before the step, minus after: -update (of the samples)
        update_norms = torch._foreach_norm(buffers)
        blocks: list[Block] = []
        values: list[torch.Tensor] = []
        if self._actv_rows:
            blocks.append(Block("actv", tuple(self._actv_rows), plan.value_ops))
            values.append(torch.cat(self._actv_values))
        self._actv_rows, self._actv_values, self._calls = [], [], {}
        for block, tensor in extra:
            blocks.append(block)
            values.append(tensor)
        for more in self.extras:
            got = more(opt, step)
            if got is not None:
                blocks.append(got[0])
                values.append(got[1])
        # sampled: the ratio is the samples' norms' ratio; the worker scales the update's norm to the whole
        blocks += [Block("_gnorm", rows, _NORM), Block("_unorm", rows, _NORM, scale), Block("_wnorm", rows, _NORM)]
        values.append(torch.stack([*grad_norms, *update_norms, *weight_norms]))  # one tensor, one read
        if plan.ur:
            torch._foreach_neg_(buffers)
            blocks.append(Block("param_update", rows, plan.value_ops))
            values.append(_stats_all(buffers, plan.value_ops, plan.eps))
        if plan.mv:
            self._moments(opt, params, rows, blocks, values)
        if self._roots:
            blocks.append(Block("_loss", (("loss", None, "", ""),), ("value",)))
            roots = self._roots
            values.append(roots[0] if len(roots) == 1 else torch.stack(roots).float().mean())
            self._roots = []
        if self._struct is not None:
            self.worker.submit(("struct", self._struct))
            self._struct = None
        self._send_meta()
        self.worker.submit(Packet(step, blocks, values))

    def _moments(self, opt: Any, params: list[torch.Tensor], rows: Any, blocks: list[Block],
                 values: list[torch.Tensor]) -> None:
        ops, eps = self.plan.value_ops, self.plan.eps
        for key in ("exp_avg", "exp_avg_sq"):
            found = [(row, opt.state[p][key]) for p, row in zip(params, rows)
                     if isinstance(opt.state.get(p, {}).get(key), torch.Tensor)]
            if found:
                blocks.append(Block(key, tuple(r for r, _ in found), ops))
                values.append(_stats_all([t for _, t in found], ops, eps))

    def _send_meta(self) -> None:
        sizes = (len(self._modules), len(self._params))
        if sizes == self._meta_sent:
            return
        self._meta_sent = sizes
        self.worker.submit(("meta", {**self.meta, "modules": list(self._modules), "params": list(self._params)}))

    def _name(self, param: torch.Tensor, index: int) -> str:
        name = self._names.get(id(param))
        if name is None:  # a parameter of no model found: named by its place in the optimizer
            return f"param_{index}"
        return name

    def _buffer(self, state: _Opt, like: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The buffer of a parameter's value before the step: float32 for 16-bit parameters, so that the difference
        (a small change of a large value) is not rounded to 16 bits."""
        dtype = torch.float32 if like.dtype in (torch.bfloat16, torch.float16) else like.dtype
        buf = state.buffers.get(id(param))
        if buf is None or buf.shape != like.shape or buf.dtype != dtype or buf.device != like.device:
            buf = state.buffers[id(param)] = torch.empty(like.shape, dtype=dtype, device=like.device)
        return buf

    def _samples(self, state: _Opt, params: list[torch.Tensor], key: tuple[int, ...], sample: int
                 ) -> tuple[list[torch.Tensor], tuple[float, ...]]:
        """Each parameter, or a fixed strided view of at most ``sample`` of its elements (a contiguous one), and per
        parameter the factor that scales a sample's norm to the whole (1 where the whole is taken)."""
        cached = state.samples.get(key)
        if cached is not None and all(v.data_ptr() == p.data_ptr() for v, p in zip(cached[0], params)):
            return cached
        views, factors = [], []
        for p in params:
            n = p.numel()
            if n > sample and p.is_contiguous():
                stride = -(-n // sample)
                view = p.detach().view(-1)[::stride]
                views.append(view)
                factors.append(math.sqrt(n / view.numel()))
            else:
                views.append(p.detach())
                factors.append(1.0)
        result = (views, tuple(factors))
        state.samples[key] = result
        return result


def _modules_in(value: Any) -> list[torch.nn.Module]:
    """A module, or the modules among an object's attributes (a trainer's ``self.model``)."""
    if isinstance(value, torch.nn.Module):
        return [value]
    if isinstance(value, type) or not hasattr(value, "__dict__"):
        return []
    try:
        attrs = vars(value)
    except TypeError:
        return []
    return [v for v in attrs.values() if isinstance(v, torch.nn.Module)]


def _clean(name: str) -> str:
    """A name without torch.compile's wrapper (``_orig_mod.``)."""
    return name.replace("_orig_mod.", "")


def _matches(name: str, targets: tuple[str, ...], *, modules: bool = False) -> bool:
    """msprobe's rule: a parameter is watched when its name starts with a target; a module when its name is a target.
    obs also takes shell patterns (``h.*.mlp``) for both."""
    for target in targets:
        if modules:
            if name == target or (any(c in target for c in "*?[") and fnmatch.fnmatchcase(name, target)):
                return True
        elif name.startswith(target) or (any(c in target for c in "*?[") and fnmatch.fnmatchcase(name, target + "*")):
            return True
    return False


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return []


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def _stats(t: torch.Tensor, ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """One tensor's statistics (msprobe's ops), as one float32 vector on its device."""
    t = t.detach()
    if t.numel() == 0:
        return torch.full((len(ops),), math.nan, device=t.device)
    f = t.float()
    out = []
    for op in ops:
        if op == "norm":
            out.append(torch.linalg.vector_norm(f))
        elif op == "min":
            out.append(f.min())
        elif op == "max":
            out.append(f.max())
        elif op == "mean":
            out.append(f.mean())
        elif op == "zeros":
            out.append((f.abs() < eps).float().mean())
        elif op == "nans":
            out.append(f.isnan().sum().float())
        else:  # id: the value of a one-element tensor
            out.append(f.reshape(-1)[0] if f.numel() == 1 else torch.tensor(math.nan, device=f.device))
    return torch.stack(out)


def _stats_all(tensors: list[torch.Tensor], ops: tuple[str, ...], eps: float) -> torch.Tensor:
    if ops == _NORM:
        return torch.stack(torch._foreach_norm(tensors)).float()
    return torch.cat([_stats(t, ops, eps) for t in tensors])


def _struct_of(value: Any) -> dict[str, Any]:
    """msprobe's print_struct entry of a module's inputs or outputs."""
    if isinstance(value, torch.Tensor):
        return {"config": "tensor", "tensor": f"size={tuple(value.shape)}, dtype={value.dtype}"}
    if isinstance(value, (tuple, list)):
        out: dict[str, Any] = {"config": f"{type(value).__name__}[{len(value)}]"}
        for i, v in enumerate(value):
            out[str(i)] = (f"size={tuple(v.shape)}, dtype={v.dtype}" if isinstance(v, torch.Tensor)
                           else str(type(v)))
        return out
    return {"config": str(type(value))}


def run_stamp() -> str:
    """msprobe's run folder time tag (``Nov29_14-03-59``), local time."""
    return time.strftime("%b%d_%H-%M-%S")


def process_meta(rank: int, world_size: int) -> dict[str, Any]:
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "started": time.time()}

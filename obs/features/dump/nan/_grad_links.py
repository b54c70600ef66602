"""Gradients the NaN/Inf check need not read: those that backward makes, without a way to become non-finite,
from a gradient the check reads.

In backward, ReLU, Hardtanh, Sigmoid, Tanh and a max-pool whose windows do not overlap make their input's
gradient from their output's gradient by a mask, a factor in [0, 1] or a move to distinct places: finite in,
finite out.  So when the gradient reaching such a module's output is checked, and the module is the only user of
its input, the gradient reaching that input (the previous module's output) is finite whenever the checked one
is, and reading it again finds nothing.  Whether the module is the input's only user is a fact of the whole
graph (a residual connection or a second loss may use the same tensor), so it is settled when backward starts:
one walk from the roots counts the edges into each such input.  An input with more than one edge is checked as
before, by a pre-hook on its autograd node.

When a backward starts without :meth:`GradLinks.settle` (a call that bypasses ``torch.autograd.backward`` and
``grad``), the covering gradient's check arms the covered ones as it runs: nothing goes unchecked.  A gradient
hook of the user's on either tensor, which could rewrite the gradient in between, leaves the pair unlinked.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ELEMENTWISE_BACKWARD", "MAX_POOLS", "GradLinks", "Watch", "preserves_in_backward"]

#: Exact types whose backward is finite-preserving (see the module docstring).
ELEMENTWISE_BACKWARD = frozenset({torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardtanh, torch.nn.Sigmoid, torch.nn.Tanh})
#: Max-pools (their dimensions), finite-preserving when their windows do not overlap.
MAX_POOLS = {torch.nn.MaxPool1d: 1, torch.nn.MaxPool2d: 2, torch.nn.MaxPool3d: 3}
_PENDING, _SKIP, _CHECK = "pending", "skip", "check"


def preserves_in_backward(module: torch.nn.Module) -> bool:
    """Whether ``module``'s backward makes a finite input gradient from every finite output gradient.

    A max-pool qualifies when its windows do not overlap (stride ≥ dilated kernel in every dimension): each input
    place then receives at most one output gradient, and no sum of them can overflow."""
    kind = type(module)
    if kind in ELEMENTWISE_BACKWARD:
        return True
    dims = MAX_POOLS.get(kind)
    if dims is None:
        return False

    def per_dim(value: Any) -> tuple[int, ...]:
        return (value,) * dims if isinstance(value, int) else tuple(value)

    kernel, stride, dilation = (per_dim(v) for v in (module.kernel_size, module.stride or module.kernel_size,
                                                      module.dilation))
    return all(s >= d * (k - 1) + 1 for k, s, d in zip(kernel, stride, dilation))


class Watch:
    """The check of the gradient reaching one module output; ``covers``: the watches it makes redundant."""

    __slots__ = ("check", "handle", "node", "slot", "consumer", "covers", "state")

    def __init__(self, check: Any) -> None:
        self.check = check  # check(gradient)
        self.handle: Any = None  # the tensor hook, while this watch is not covered
        self.node: Any = None  # covered: the tensor's autograd node and output slot, and its one user's node
        self.slot = 0
        self.consumer: Any = None
        self.covers: list[Watch] = []
        self.state = _CHECK

    def on_gradient(self, grad: torch.Tensor) -> None:
        for covered in self.covers:
            if covered.state == _PENDING:  # no settle for this backward: check it after all
                covered.arm()
        self.check(grad)

    def arm(self) -> None:
        """Check this covered gradient after all: a pre-hook on its node reads its slot."""
        self.state = _CHECK
        slot, on_gradient = self.slot, self.on_gradient
        self.node.register_prehook(lambda grads: on_gradient(grads[slot]))


class GradLinks:
    """The step's gradient watches, and which of them another one covers."""

    def __init__(self) -> None:
        self._watches: dict[int, tuple[Any, Watch]] = {}  # id(tensor) → (weakref to it, its watch), this step
        self._covered: list[Watch] = []

    def new_step(self) -> None:
        self._watches.clear()
        self._covered = []

    def watch(self, tensor: torch.Tensor, check: Any) -> Watch:
        """Check the gradient reaching ``tensor`` (a tensor hook, unless :meth:`cover` later links it)."""
        watch = Watch(check)
        watch.handle = tensor.register_hook(watch.on_gradient)
        self._watches[id(tensor)] = (weakref.ref(tensor), watch)
        return watch

    def cover(self, args: tuple[Any, ...], output: torch.Tensor, output_watch: Watch) -> None:
        """``output`` (watched by ``output_watch``) is made by a module that :func:`preserves_in_backward` from
        ``args``: when that is one watched tensor, its gradient is covered, pending the graph's check."""
        if len(args) != 1:
            return
        tensor = args[0]
        entry = self._watches.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return
        watch = entry[1]
        node = tensor.grad_fn
        if watch.handle is None or node is None or output.grad_fn is None or \
                output.data_ptr() == tensor.data_ptr() or len(tensor._backward_hooks) != 1 or \
                len(output._backward_hooks) != 1:
            return  # covered already, a leaf, in place, or someone else's hook could rewrite a gradient
        watch.handle.remove()
        watch.handle = None
        watch.node, watch.slot, watch.consumer, watch.state = node, tensor.output_nr, output.grad_fn, _PENDING
        output_watch.covers.append(watch)
        self._covered.append(watch)

    def settle(self, roots: Any) -> None:
        """Before a backward from ``roots``: a covered gradient stays unread when the one edge into it comes
        from its covering module (or none does); every other is armed.  One walk of the graph."""
        open_ = [w for w in self._covered if w.state != _CHECK]
        if not open_:
            return
        edges = {(id(w.node), w.slot): 0 for w in open_}
        if isinstance(roots, torch.Tensor):
            roots = (roots,)
        stack = [t.grad_fn for t in roots or () if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        alive: list[Any] = []  # every node walked stays alive until the end: ids are not reused
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            alive.append(node)
            for child, slot in node.next_functions:
                if child is not None:
                    key = (id(child), slot)
                    if key in edges:
                        edges[key] += 1
                    stack.append(child)
        for watch in open_:
            count = edges[(id(watch.node), watch.slot)]
            if count == 0 or (count == 1 and id(watch.consumer) in seen):
                watch.state = _SKIP
            else:
                watch.arm()

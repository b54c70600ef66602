"""Module activations for the monitor (``xy_distribution``): forward hooks on the chosen modules, the statistics of
each call's floating-point inputs and outputs, kept until the step's packet.

Norms alone (the default ``ops``) of dense CPU tensors come from the native pass of
:mod:`obs.features.monitor.norms`: one call per module call for its inputs and outputs together, a list of floats,
no torch op (so no ``no_grad`` or suppression either).  Anything else is computed with torch ops on the tensors'
device (one float32 vector per call, on CUDA joined into the step's batch).  A call's rows (names, shapes, dtypes) are
formatted once per module, call and shapes, not at every step.  Only in training mode and under grad, in eager mode.
"""

from __future__ import annotations

from typing import Any

import torch

from obs._core.internal import report_internal_error, suppressed
from obs.features.monitor.norms import CODES, EXTENSION
from obs.features.monitor.stats import NORM, shape_of, stats, stats_all, struct_of, tensors_in
from obs.features.monitor.step_plan import same_rows
from obs.features.monitor.writer import Block

__all__ = ["Activations"]

Row = tuple[str, "int | None", str, str]


class Activations:
    """One run's activation hooks' state: the rows and values of the step so far."""

    def __init__(self, ops: tuple[str, ...], eps: float, *, struct: bool) -> None:
        self.ops, self.eps = ops, eps
        self.due = True  #: whether the step now is collected (the collector sets it at each step)
        self.struct: dict[str, dict[str, Any]] | None = {} if struct else None  #: msprobe's print_struct
        self.rows: list[Row] = []
        self.parts: list[Any] = []
        self.calls: dict[str, int] = {}
        self._cached: dict[tuple[str, int], tuple[Any, list[Row], tuple[int, ...], tuple[int, ...] | None]] = {}
        self._lib = EXTENSION.load() if ops == NORM else None
        self._last_rows: tuple[Row, ...] = ()

    def hook(self, name: str, watched: bool) -> Any:
        """The forward hook of module ``name`` (``watched``: its activations are collected; else only its struct)."""
        me = self

        def obs_monitor_xy(mod: Any, args: Any, output: Any) -> None:
            if not mod.training or not torch.is_grad_enabled():
                return
            try:
                if me.struct is not None and name not in me.struct:
                    me.struct[name] = {"input": struct_of(args), "output": struct_of(output)}
                if watched and me.due:
                    me.record(name, args, output)
            except Exception as exc:  # noqa: BLE001 - reported; never raised into the forward
                report_internal_error("monitor: activations", exc)

        return obs_monitor_xy

    def record(self, name: str, args: Any, output: Any) -> None:
        """One call's inputs' and outputs' statistics."""
        micro = self.calls.get(name, 0)
        self.calls[name] = micro + 1
        ins, outs = tensors_in(args), tensors_in(output)
        tensors = ins + outs
        if not tensors:
            return
        signature = tuple((t.shape, t.dtype, t.is_cpu) for t in tensors)
        cached = self._cached.get((name, micro))
        if cached is None or cached[0] != signature:
            cached = self._cached[(name, micro)] = self._rows(name, micro, ins, outs, signature)
        _, rows, counts, codes = cached
        self.rows.extend(rows)
        if codes is not None and all(t.is_contiguous() for t in tensors):
            self.parts.append(self._lib.norms([t.data_ptr() for t in tensors], counts, codes))
            return
        with torch.no_grad(), suppressed():
            if self.ops == NORM:
                self.parts.append(stats_all([t.detach() for t in tensors], NORM, self.eps))
            else:
                self.parts.append(torch.cat([stats(t, self.ops, self.eps) for t in tensors]))

    def _rows(self, name: str, micro: int, ins: list[torch.Tensor], outs: list[torch.Tensor], signature: Any
              ) -> tuple[Any, list[Row], tuple[int, ...], tuple[int, ...] | None]:
        rows: list[Row] = []
        for label, tensors in (("input", ins), ("output", outs)):
            for i, t in enumerate(tensors):
                row = f"{name}.{label}" if len(tensors) == 1 else f"{name}.{label}_{i}"
                rows.append((row, micro, shape_of(t), str(t.dtype)))
        every = ins + outs
        native = self._lib is not None and all(t.is_cpu and t.dtype in CODES for t in every)
        codes = tuple(CODES[t.dtype] for t in every) if native else None
        return signature, rows, tuple(t.numel() for t in every), codes

    def take(self, ops: tuple[str, ...]) -> tuple[Block, list[Any]] | None:
        """The step's block and values (None when no call was recorded), and a fresh step."""
        rows, parts = self.rows, self.parts
        self.rows, self.parts, self.calls = [], [], {}
        if not rows:
            return None
        self._last_rows = same_rows(rows, self._last_rows)
        return Block("actv", self._last_rows, ops), parts

    def clear(self) -> None:
        self.rows, self.parts, self.calls = [], [], {}

"""``format: tensorboard``: every judged step's values as TensorBoard scalars, in msprobe's tag layout (a sink of
the monitor's worker thread, :class:`~obs.features.monitor.writer.StepValues` in).

Written with ``tensorboardX`` (the ``tensorboard`` extra: ``pip install 'obs-runtime[tensorboard]'``), into the run
folder, beside the CSV files, as msprobe's ``SummaryWriter`` does.  Tags are msprobe's:
``{vpp_stage}:{name}/rank{r}/{tag}_{stat}`` (``/rank{r}`` only in a job of several ranks), ``tag`` being msprobe's name
of the series (``post_grad`` for the reduced gradients, ``pre_grad`` the unreduced ones, ``actv``, ``exp_avg``,
``exp_avg_sq``; obs's own ``param_update`` and ``update_ratio``); the loss and the global gradient norm are ``loss``
and ``grad_norm`` (``loss/rank{r}`` in a job), and each anomaly adds one to ``anomalies/{kind}`` at its step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from obs._core.errors import ObsConfigError
from obs.features.monitor.metrics import kind_of

__all__ = ["INSTALL", "TAGS", "TensorBoardSink", "require_writer", "tag_of"]

INSTALL = "pip install 'obs-runtime[tensorboard]'"  #: what the error of a missing extra says to run

#: a CSV file prefix -> msprobe's TensorBoard tag of that series
TAGS = {"grad_reduced": "post_grad", "grad_unreduced": "pre_grad", "actv": "actv", "actv_grad": "actv_grad",
        "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param_update": "param_update",
        "update_ratio": "update_ratio"}


def require_writer() -> tuple[Any, Any]:
    """tensorboardX's ``FileWriter`` and ``Summary``; an :class:`~obs._core.errors.ObsConfigError` naming the extra
    when it is not installed."""
    try:
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary
    except ImportError as exc:
        raise ObsConfigError(f"monitor.format 'tensorboard' needs the 'tensorboard' extra of obs (tensorboardX, not "
                             f"importable here: {exc}); install it with: {INSTALL}") from None
    return FileWriter, Summary


def tag_of(prefix: str, name: str, micro: int | None, stat: str, rank: int | None) -> str:
    """The TensorBoard tag of one value (msprobe's ``get_summary_writer_tag_name`` and ``'{key}_{op}'``)."""
    where = f"/rank{rank}" if rank is not None else ""
    if prefix == "scalars":
        return f"{name}{where}"
    if prefix == "other":  # a collective's row {op}/{pre|post}_{i}: msprobe's {op}/rank{r}/{pre|post}_{i}_{op}
        op, _, side = name.partition("/")
        return f"{op}{f'.call{micro}' if micro else ''}{where}/{side}_{stat}"
    if micro:
        name = f"{name}.call{micro}"
    return f"0:{name}{where}/{TAGS.get(prefix, prefix)}_{stat}"


class TensorBoardSink:
    """Writes each :class:`~obs.features.monitor.writer.StepValues` as one event (every value of the step a scalar)
    into one event file under ``folder`` (called on the worker thread only); ``rank`` is in the tags when the job has
    several ranks.  The tags are written as given (tensorboardX's ``add_scalar`` would turn msprobe's ``:`` into
    ``_``)."""

    def __init__(self, folder: str, *, rank: int, world_size: int, flush_secs: int = 10) -> None:
        writer, self._summary = require_writer()
        self.rank = rank if world_size > 1 else None
        self.writer = writer(folder, flush_secs=flush_secs)
        self.anomalies: Counter[str] = Counter()
        self._tags: dict[tuple[str, str, int | None, str], str] = {}

    def __call__(self, values: Any) -> None:
        value_type, tags, points = self._summary.Value, self._tags, []
        for prefix, name, micro, stat, value in values.values:
            key = (prefix, name, micro, stat)
            tag = tags.get(key)
            if tag is None:
                tag = tags[key] = tag_of(prefix, name, micro, stat, self.rank)
            points.append(value_type(tag=tag, simple_value=value))
        if values.anomalies:
            kinds = [kind_of(a) for a in values.anomalies]
            self.anomalies.update(kinds)
            where = f"/rank{self.rank}" if self.rank is not None else ""
            points += [value_type(tag=f"anomalies/{kind}{where}", simple_value=self.anomalies[kind])
                       for kind in sorted(set(kinds))]
        if points:
            self.writer.add_summary(self._summary(value=points), values.step)

    def close(self) -> None:
        self.writer.close()

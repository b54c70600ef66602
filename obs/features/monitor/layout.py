"""The monitor's files: msprobe's CSV layout (names, headers), the series kinds and training stages, ``monitor.json``.

Shared by the writer (:mod:`obs.features.monitor.writer`) and the pure reader (:mod:`obs.features.monitor.reader`).
A run writes ``{root}/{Mon}{DD}_{HH-MM-SS}-rank{r}-{id}/`` (msprobe's run folder, so msprobe's own tools find it),
holding ``{prefix}_{first}-{last}.csv`` files (``step_count_per_record`` steps each) and ``monitor.json``.
"""

from __future__ import annotations

import re

__all__ = ["CSV_HEADER", "CSV_HEADER_MICRO_STEP", "CSV_PATTERN", "KINDS", "META", "PREFIXES", "RUN_FOLDER",
           "SCHEMA_VERSION", "STAGES", "VALUE_OPS", "columns", "is_micro", "kind_stage"]

SCHEMA_VERSION = 1
META = "monitor.json"  #: the run's metadata: settings, rank, module and parameter order

#: msprobe's leading columns (MonitorConst.CSV_HEADER and CSV_HEADER_MICRO_STEP)
CSV_HEADER = ("vpp_stage", "name", "step")
CSV_HEADER_MICRO_STEP = ("vpp_stage", "name", "step", "micro_step")

#: a file's prefix -> (kind, stage).  actv, grad_reduced, exp_avg and exp_avg_sq are msprobe's own files; msprobe
#: draws updates only as TensorBoard heatmaps, so param_update (the norm of each step's change of a parameter),
#: update_ratio (that over the parameter's norm before the step) and scalars (loss, global grad_norm) are obs's, in
#: the same layout.
PREFIXES: dict[str, tuple[str, str]] = {
    "actv": ("xy", "forward"),
    "grad_reduced": ("wg", "backward"),
    "exp_avg": ("mv", "optimizer"),
    "exp_avg_sq": ("mv", "optimizer"),
    "update_ratio": ("ur", "optimizer"),
    "param_update": ("ur", "optimizer"),
    "scalars": ("", ""),  # per row: loss (forward's end), grad_norm (backward's end)
    "other": ("cc", "communication"),  # the collectives (collectives.py): after backward, before the optimizer
    # msprobe's files obs does not write (yet), read back as msprobe wrote them
    "grad_unreduced": ("wg", "backward"),
    "actv_grad": ("xy", "backward"),
    "param_origin": ("wg", "optimizer"),
    "param_updated": ("ur", "optimizer"),
}


def kind_stage(prefix: str, name: str) -> tuple[str, str]:
    """A row's kind and stage: its file's, or for scalars its own (loss: forward, grad_norm: backward)."""
    if prefix == "scalars":
        return ("loss", "forward") if name == "loss" else ("wg", "backward")
    return PREFIXES.get(prefix, ("", ""))
KINDS = ("xy", "wg", "mv", "ur", "cc", "loss")
STAGES = ("forward", "backward", "communication", "optimizer")
#: statistics that are numbers (shape and dtype are text columns)
VALUE_OPS = ("norm", "min", "max", "zeros", "nans", "id", "mean")

#: msprobe's run folder (MonitorConst.OUTPUT_DIR_PATTERN) and CSV file names (CSV_FILE_PATTERN)
RUN_FOLDER = re.compile(r"([\w-]{0,20})-rank(\d{1,5})-([0-9a-f]{1,32})")
CSV_PATTERN = re.compile(r"(\w+?)_(\d+)-(\d+)\.csv")


def is_micro(prefix: str) -> bool:
    """Activations and collectives carry a micro_step column (each call of the module or op within the step)."""
    return prefix in ("actv", "actv_grad", "other")


def columns(prefix: str, ops: list[str]) -> list[str]:
    """A file's header: msprobe's leading columns, then its statistics, with shape and dtype added as msprobe does
    (``validate_ops``); update_ratio's one statistic is ``ratio``, scalars' ``value``."""
    if prefix == "update_ratio":
        stats = ["ratio"]
    elif prefix == "scalars":
        stats = ["value"]
    else:
        stats = list(ops) + [c for c in ("shape", "dtype") if c not in ops]
    return list(CSV_HEADER_MICRO_STEP if is_micro(prefix) else CSV_HEADER) + stats

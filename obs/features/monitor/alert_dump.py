"""msprobe's ``alert.dump``: the anomalies in msprobe's own file, so that its analysis tool reads them.

A sink of the worker (on the ``obs-monitor`` thread).  With ``alert: {"dump": true}``, each anomalous step rewrites
``{root}/anomaly_detected/rank{r}/anomaly.json`` (``root``: the monitor's output root, ``MONITOR_OUTPUT_DIR`` first,
as msprobe's ``AnomalyDataWriter``), one JSON object whose keys are ``{tag_name}_step_{step}_call_{call_id}`` and whose
values hold msprobe's ``GradAnomalyData`` fields: ``rank``, ``step``, ``micro_step``, ``pp_stage``, ``vpp_stage``,
``call_id``, ``tag_name`` (``0:{name}/rank{r}/{task}``; msprobe's tasks where it has them: ``post_grad`` for the
gradients, ``actv`` for activations, with the call as ``:{micro}``, ``exp_avg``, ``exp_avg_sq``; else the CSV's
prefix), ``message`` and ``group_mates``.  msprobe's ``msprobe -f pytorch anomaly_analyse`` (its
``anomaly_analyse.py``) sorts them.  At most :data:`LIMIT` entries (the first ones, which matter most).
"""

from __future__ import annotations

import json
import os
from typing import Any

from obs._core import safe_files
from obs._core.outputs import wrote

__all__ = ["FILE", "FOLDER", "LIMIT", "AlertDump"]

FOLDER = "anomaly_detected"
FILE = "anomaly.json"
LIMIT = 10_000
_TASKS = {"grad_reduced": "post_grad", "grad_unreduced": "pre_grad", "actv": "actv", "actv_grad": "actv_grad"}


class AlertDump:
    """The sink writing ``anomaly_detected/rank{r}/anomaly.json``."""

    def __init__(self, root: str, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.folder = os.path.join(root, FOLDER, f"rank{rank}")
        self.path = os.path.join(self.folder, FILE)
        self.entries: dict[str, dict[str, Any]] = {}
        self._started = False

    def wants_values(self) -> bool:
        return False  # the step's anomalies only

    def __call__(self, step_values: Any) -> None:
        if not step_values.anomalies or len(self.entries) >= LIMIT:
            return
        for a in step_values.anomalies:
            if len(self.entries) >= LIMIT:
                break
            name = a.name if a.micro is None else f"{a.name}:{a.micro}"
            tag = f"0:{name}/rank{self.rank}/{_TASKS.get(a.prefix, a.prefix)}"
            call_id = -1
            key = f"{tag}_step_{a.step}_call_{call_id}"
            if key in self.entries:  # one entry per tensor and step, as msprobe keys them: the first statistic
                continue
            self.entries[key] = {
                "rank": self.rank, "step": a.step, "micro_step": a.micro or 0, "pp_stage": 0, "vpp_stage": 0,
                "call_id": call_id, "tag_name": tag,
                "message": f"Rule {a.rule} reports anomaly signal in ('{tag}', '{a.stat}') at step {a.step}: "
                           f"{a.value:.6g}, baseline {a.baseline:.6g}",
                "group_mates": list(range(self.world_size))}
        if not self._started:
            safe_files.ensure_dir(self.folder)
            self._started = True
            wrote("monitor anomalies (msprobe's alert.dump)", self.path)
        safe_files.write_atomic(self.path, json.dumps(self.entries, indent=1), fsync=False)

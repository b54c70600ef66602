"""The ``capture`` action: the steps after an anomaly, in detail.

:func:`start` (called on the monitor's worker thread) asks for two things over the next ``steps`` steps:

- the data dump's statistics (:class:`obs.features.dump.data_dump.DataDump`, ``saved_data: statistic``): a
  ``statistic.csv`` per step in MindSpore's layout under ``{folder}/capture_step{N}/``, read with ``obs dump``.  A
  data dump installs hooks, so it starts at the next step boundary on the training thread (``tracker.at_boundary``)
  and is removed there after ``steps`` steps;
- a profiler capture window (``task_trace``: module spans) in the profiling session in force, the same window
  ``obs trace capture`` asks for; nothing when the profiler is off.
"""

from __future__ import annotations

import os
from typing import Any

from obs._core import safe_files
from obs._core.internal import report_internal_error

__all__ = ["DumpWindow", "start"]

STATISTICS = ["max", "min", "avg", "l2norm", "nan count", "negative inf count", "positive inf count"]


class DumpWindow:
    """A data dump of statistics over ``steps`` steps from the next step boundary (on the training thread)."""

    def __init__(self, folder: str, steps: int) -> None:
        from obs.runtime.steps import tracker
        from obs.settings.dump_config import parse_dump_config

        self.folder = folder
        self.config = parse_dump_config({"common_dump_settings": {
            "dump_mode": 0, "path": folder, "net_name": "Net", "iteration": "all", "saved_data": "statistic",
            "input_output": 0, "kernels": [], "support_device": [0], "statistic_category": STATISTICS}},
            source="monitor capture")
        self.left = steps
        self.until = -1  #: the last step dumped, known once the dump starts
        self.dump: Any = None
        self.done = False
        self._handle = tracker.at_boundary.add(self._boundary)

    def _boundary(self) -> None:
        """At every step boundary (a step's end and the next one's begin): start before the first step, end after
        the last."""
        from obs.runtime.steps import tracker

        try:
            if self.dump is None and not self.done:
                from obs.features.dump.data_dump import DataDump

                safe_files.ensure_dir(self.folder)
                self.until = tracker.step + self.left  # the steps after the one that just ended
                self.dump = DataDump(self.config).install()
            elif not tracker.in_step and tracker.step >= self.until:
                self.close()
        except Exception as exc:  # noqa: BLE001 - reported; the training loop goes on
            report_internal_error("monitor: capture's data dump", exc)
            self.close()

    def close(self) -> None:
        self._handle.remove()
        dump, self.dump = self.dump, None
        if dump is not None:
            dump.remove()
            dump.flush(10.0)
        self.done = True


def start(step: int, steps: int, folder: str) -> DumpWindow:
    """The capture of ``steps`` steps from the next boundary (``step``: the monitor's step it follows)."""
    window = DumpWindow(os.path.join(folder, f"capture_step{step}"), steps)
    from obs.features.profiling.feature import feature as profiler

    session = profiler.session
    if session is not None:
        session.windows.ask(steps, "task_trace")
    return window

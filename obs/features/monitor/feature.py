"""The monitor's applier: the env config's ``monitor`` section (and the msprobe file it names) to a running monitor.

While ``monitor.enable`` is on (and this rank is one of ``module_ranks``), a :class:`Monitor` holds the hooks
(:mod:`obs.features.monitor.collect`) and the worker thread (:mod:`obs.features.monitor.writer`).  A change of the
section (a hot reload is applied at a step boundary, on the training thread) ends the run in force, its files
complete, and starts one in a new run folder; switching off ends it.  At exit the last run is flushed.

The output root: ``MONITOR_OUTPUT_DIR`` (as msprobe), else ``monitor.path``, else ``./monitor_output``.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from obs._core import env, safe_files
from obs.features import env_config as env_feature
from obs.settings.monitor_options import merged

__all__ = ["Monitor", "MonitorFeature", "feature", "output_root"]

logger = logging.getLogger("obs")


def output_root(section: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """Where runs go: ``MONITOR_OUTPUT_DIR``, else the section's ``path``, else ``./monitor_output``."""
    return os.path.abspath(env.text(env.MONITOR_OUTPUT_DIR, "", environ) or section.get("path") or "monitor_output")


def _ring_marker(anomaly: Any, kind: str) -> None:
    """An anomaly as a marker in the RDR ring, when the recorder is on: bundles (and ``obs rdr events --kind
    marker``) show it beside the step it came in."""
    from obs.features.rdr.feature import recorder

    live = recorder()
    if live is not None:
        live.marker("anomaly", monitor_step=anomaly.step, monitor_kind=kind, tensor=anomaly.name, series=anomaly.prefix,
                    stat=anomaly.stat, value=anomaly.value, baseline=anomaly.baseline, rule=anomaly.rule)


def _outputs(settings: Mapping[str, Any], folder: str | None, rank: int, world_size: int) -> list[Any]:
    """The worker's sinks besides CSV: the metrics (through the profiler's, when on) and, with ``format:
    tensorboard``, the event file; a missing ``tensorboard`` extra is said once and the CSV files still written."""
    from obs._core.errors import ObsConfigError
    from obs._core.internal import report_internal_error
    from obs.features.monitor.metrics import MetricsSink

    sinks: list[Any] = [MetricsSink()]
    if settings["format"] == "tensorboard" and folder is not None:
        from obs.features.monitor.tensorboard import TensorBoardSink

        try:
            sinks.append(TensorBoardSink(folder, rank=rank, world_size=world_size))
        except ObsConfigError as exc:
            logger.error("obs: monitor: %s; the CSV files are written without it", exc)
        except Exception as exc:  # noqa: BLE001 - an unwritable event file: reported, the CSV files still written
            report_internal_error("monitor tensorboard", exc)
    return sinks
def _identity() -> dict[str, Any]:
    """monitor.json's host and job id (clock.py), never an error that stops the monitor."""
    from obs.features.monitor.clock import identity

    try:
        return identity()
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on without them
        from obs._core.internal import report_internal_error

        report_internal_error("monitor: identity", exc)
        return {}


class Monitor:
    """One run: its folder, its hooks and its worker thread."""

    def __init__(self, settings: Mapping[str, Any], rank: int, world_size: int) -> None:
        from obs.features.monitor.actions import Actions
        from obs.features.monitor.collect import Collector, Plan, process_meta, run_stamp
        from obs.features.monitor.detect import Detector, rules_from
        from obs.features.monitor.ring_region import RingRegion
        from obs.features.monitor.writer import Worker

        targets = tuple(settings["targets"]) or ("",)
        self.plan = Plan(ops=tuple(settings["ops"]), eps=settings["eps"], targets=targets,
                         xy=settings["xy_distribution"], all_xy=settings["all_xy"] or (
                             settings["xy_distribution"] and not settings["targets"]),
                         wg=settings["wg_distribution"], mv=settings["mv_distribution"],
                         ur=settings["ur_distribution"], start_step=settings["start_step"],
                         step_interval=settings["step_interval"], collect_times=settings["collect_times"],
                         print_struct=settings["print_struct"], update_sample=settings["update_sample"])
        self.folder: str | None = None
        if settings["format"] != "api":
            root = output_root(settings)
            safe_files.ensure_dir(root)
            self.folder = os.path.join(root, f"{run_stamp()}-rank{rank}-{secrets.token_hex(4)}")
            safe_files.ensure_dir(self.folder)
        rules = rules_from(settings["window"], settings["warmup"], settings["threshold"], settings["alert"])
        # sinks: the RDR ring's region first, so that an anomaly's bundle holds the step it flags
        sinks: list[Any] = [RingRegion(settings["ring_steps"])]
        if settings["alert"].get("dump"):  # msprobe's anomaly_detected/rank{r}/anomaly.json
            from obs.features.monitor.alert_dump import AlertDump

            sinks.append(AlertDump(output_root(settings), rank, world_size))
        self.actions: Actions | None = None
        if settings["on_anomaly"]:
            self.actions = Actions(settings["on_anomaly"], capture_steps=settings["capture_steps"],
                                   ring_steps=settings["ring_steps"], folder=self.folder or output_root(settings))
            sinks.append(self.actions)
        self.worker = Worker(self.folder, detector=Detector(rules), ndigits=settings["ndigits"],
                             per_file=settings["step_count_per_record"], on_anomaly=_ring_marker, sinks=sinks)
        self.outputs = _outputs(settings, self.folder, rank, world_size)
        self.worker.sinks.extend(self.outputs)
        self.times: Any = None
        if self.folder is not None:  # each step's wall time: the ranks of a job lined up (clock.py)
            from obs.features.monitor.clock import StepTimes

            self.times = StepTimes(self.folder)
            self.worker.on_step = self.times
        meta = {**process_meta(rank, world_size), **_identity(), "settings": {
            k: settings[k] for k in ("ops", "eps", "window", "warmup", "threshold", "alert", "step_count_per_record",
                                     "start_step", "step_interval", "targets", "update_sample")}}
        self.collector = Collector(self.plan, self.worker, meta).install()
        if self.times is not None:
            self.times.meta = self.collector.meta
        self.unreduced: Any = None
        if self.plan.wg:  # msprobe's grad_unreduced, in a job of several ranks (unreduced.py)
            from obs.features.monitor.unreduced import Unreduced

            self.unreduced = Unreduced(self.collector)
        self.cc: Any = None
        if settings["cc_distribution"].get("enable"):  # msprobe's cc: the Python collectives (collectives.py)
            from obs.features.monitor.collectives import Collectives

            self.cc = Collectives(self.collector, settings["cc_distribution"], self.folder)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every collected step is written and judged (tests, exit)."""
        done = self.worker.flush(timeout)
        if done and self.times is not None:  # the worker is idle now: its step times written too
            self.times.flush()
        return done

    def close(self) -> None:
        self.collector.remove()
        if self.cc is not None:
            self.cc.remove()
        if self.unreduced is not None:
            self.unreduced.remove()
        self.worker.flush()
        self.worker.close()
        for output in self.outputs:
            if hasattr(output, "close"):
                output.close()
        if self.actions is not None:
            self.actions.close()
        if self.times is not None:
            self.times.close()


class MonitorFeature:
    """Starts, restarts and stops the monitor to match the ``monitor`` section in force."""

    keys = frozenset({"env_config_path"})

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.monitor: Monitor | None = None
        self._want: Any = None
        self._atexit = False
        env_feature.feature.listeners.append(self.sync)

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        return None

    def commit(self, prepared: None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        self.sync()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def desired(self) -> dict[str, Any] | None:
        cfg = env_feature.feature.current()
        section = cfg.values.get("monitor", {})
        if not section.get("enable"):
            return None
        return merged(section, cfg.origins.get("monitor", {}))

    def sync(self) -> None:
        with self._lock:
            want = self.desired()
            if want == self._want:
                return
            self._stop()
            if want is not None:
                self._start(want)

    def _start(self, want: dict[str, Any]) -> None:
        from obs.runtime import job

        who = job.identity()
        ranks = want["module_ranks"]
        self._want = want
        if ranks and who.rank not in ranks:
            return
        self.monitor = Monitor(want, who.rank, who.world_size)
        if not self._atexit:
            self._atexit = True
            atexit.register(self.close)

    def _stop(self) -> None:
        monitor, self.monitor, self._want = self.monitor, None, None
        if monitor is not None:
            monitor.close()


feature = MonitorFeature()

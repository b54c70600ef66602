"""The exporter process: follows a trainer's profile ring, builds each step's spans, sends or writes them.

``python -m exporters --config JSON`` (started by ``obs``; the JSON is :class:`ExportConfig`'s fields).
It ends when the trainer closes its end of the stdin pipe, or dies however it dies (the pipe closes, the
parent pid changes): it then reads what is left in the ring, which outlives the trainer, exports it,
writes ``status_<trainer pid>.json`` (counts and the summary) and removes the ring.  Also runnable on
a thread (:func:`run` with an ``alive`` callable) where no process can be started.  With ``metrics`` it also
records each step's metrics (:mod:`exporters.metrics`) and serves or sends them.  The exporter of a restarted
session (a hot reload) begins once the earlier session's exporter has ended (``after``) and keeps the statuses of
the trainer's earlier sessions in its own (``previous``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from obs._core import env

__all__ = ["ExportConfig", "Exporter", "main", "run"]

_AFTER_WAIT_S = 30.0  # the longest wait for an earlier session's exporter (one that crashed leaves its ring)


@dataclass(frozen=True)
class ExportConfig:
    ring: str
    folder: str
    levels: tuple[str, ...] = ("training_trace",)
    endpoint: str = ""
    protocol: str = ""
    steps: Any = ""
    span_budget: int = 50
    module_depth: int = 3
    max_file_mb: int = 100
    trainer_pid: int = 0
    poll_s: float = 0.1
    flush_deadline_s: float = 2.0
    keep_ring: bool = False
    metrics: tuple[str, ...] = ()  #: metric exporters: otlp, prometheus
    prometheus_host: str = "localhost"
    prometheus_port: int = 9464  #: this rank's (the base port plus LOCAL_RANK)
    batch_size: int = 0
    tokens_per_step: int = 0
    #: rings of this trainer's earlier sessions whose exporters may still write to ``folder`` (each removes its ring
    #: last): this one starts once they are gone, so the folder's trace and status files have one writer at a time
    after: tuple[str, ...] = ()
    #: where this rank announces its Prometheus endpoint for file service discovery (:mod:`exporters.file_sd`); ''
    targets: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ExportConfig:
        data = json.loads(text)
        data["levels"] = tuple(data.get("levels", ("training_trace",)))
        data["metrics"] = tuple(data.get("metrics", ()))
        data["after"] = tuple(data.get("after", ()))
        return cls(**data)


@dataclass
class Counts:
    steps: int = 0
    spans: int = 0
    written: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


class Exporter:
    """Ring → spans → OTLP sender or local files; :meth:`step` does one poll."""

    def __init__(self, config: ExportConfig) -> None:
        from exporters.follow import RingFollower, StepAssembler
        from exporters.otlp import endpoint_from_env, protocol_from_env, resource
        from exporters.running_summary import RunningSummary
        from exporters.step_filter import parse_steps

        self.config = config
        self.follower = RingFollower(config.ring)
        header = self.follower.header
        self.rank, self.world_size, self.run_id = header.rank, header.world_size, str(header.meta.get("run_id", ""))
        self.assembler = StepAssembler(self.follower)
        self.selection = parse_steps(config.steps)
        self.summary = RunningSummary()  # bounded: a run may last weeks
        self.counts = Counts()
        self.resource = resource(header.meta, rank=header.rank, world_size=header.world_size, pid=header.pid)
        self.notes: list[str] = []
        disabled = env.text(env.OTEL_SDK_DISABLED).strip().lower() == "true"  # the spec: only "true"
        endpoint = config.endpoint or endpoint_from_env()
        if endpoint and disabled:
            self.notes.append(f"OTEL_SDK_DISABLED=true: nothing sent to {endpoint}; traces go to the local files")
            endpoint = ""
        self.endpoint = endpoint
        self.protocol = config.protocol or protocol_from_env()
        self.sender: Any = None
        self.jsonl: Any = None
        self.chrome: Any = None
        if endpoint:
            from exporters.otlp import OtlpSender

            self.sender = OtlpSender(config.endpoint, self.protocol)
        else:
            from exporters.local_files import ChromeTraceWriter, OtlpJsonWriter

            limit = config.max_file_mb << 20
            self.jsonl = OtlpJsonWriter(config.folder, limit)
            self.chrome = ChromeTraceWriter(config.folder, limit, rank=header.rank, pid=header.pid)
        self._shown_drops = 0
        self.previous = self._previous()
        self._last_step: int | None = None
        self.lost_steps = 0  #: steps overwritten in the ring before the exporter read them
        self.metrics: Any = None
        if config.metrics and disabled:
            self.notes.append("OTEL_SDK_DISABLED=true: no metrics")
        elif config.metrics:
            from exporters.metrics import Metrics

            self.metrics = Metrics(config, self.resource, rank=header.rank, name=self.follower.string,
                                   environ=os.environ, started=header.wall_ns / 1e9)
        self.target: Any = None
        if self.metrics is not None and config.targets and "prometheus" in config.metrics:
            from exporters.file_sd import TargetFile

            self.target = TargetFile(config.targets, pid=config.trainer_pid or os.getpid())

    def step(self, *, final: bool = False) -> None:
        if not final and self.sender is not None and self.sender.backlog >= self.sender.max_spans:
            return  # the collector is behind: the slots wait in the ring (an overrun there is counted)
        seen = len(self.follower.markers)
        slots = self.follower.poll(final=final)
        for marker in self.follower.markers[seen:]:
            if marker.get("marker") == "identity":
                self._identity(marker)
            elif marker.get("marker") == "nan_inf" and self.metrics is not None:
                self.metrics.nonfinite += 1
        records = self.assembler.feed(slots)
        records += self.assembler.drain() if final else self.assembler.idle(time.time_ns())
        if self.metrics is not None:
            self.metrics.feed(slots, records)  # every step, whatever `steps` selects for the traces
            self._announce()
        self._export(records, final=final)

    def _announce(self) -> None:
        """This rank's file-SD entry, once its endpoint listens, rewritten when its rank or run id changes."""
        if self.target is None or not self.metrics.serving:
            return
        from exporters.file_sd import target_address

        address = target_address(self.config.prometheus_host, self.config.prometheus_port, self.target.node)
        try:
            local_rank = env.integer(env.LOCAL_RANK, 0)
        except ValueError:
            local_rank = -1
        try:
            self.target.write(address, run_id=self.run_id, rank=self.rank, local_rank=local_rank)
        except OSError as exc:
            self.notes.append(f"cannot write the Prometheus target file {self.target.path}: {exc}")
            self.target = None

    def _identity(self, marker: dict[str, Any]) -> None:
        """The trainer learnt its rank and the job's run id (after init_process_group): later steps carry them."""
        from exporters.otlp import resource

        header = self.follower.header
        self.run_id = str(marker.get("run_id") or self.run_id)
        self.rank = int(marker.get("rank", self.rank))
        self.world_size = int(marker.get("world_size", self.world_size))
        self.resource = resource({**header.meta, "run_id": self.run_id}, rank=self.rank, world_size=self.world_size,
                                 pid=header.pid)
        if self.metrics is not None:
            self.metrics.identity(self.resource, self.rank)

    def _export(self, records: list[Any], *, final: bool = False) -> None:
        from exporters.otlp import readable_spans, request_json
        from exporters.spans import build_spans

        spans = []
        for record in records:
            self._count_gap(record.step)
            if not self.selection.selected(record.step):
                continue
            built = build_spans(record, run_id=self.run_id, rank=self.rank, world_size=self.world_size,
                                levels=self.config.levels, budget=self.config.span_budget,
                                module_depth=self.config.module_depth)
            self.summary.add(built)
            self.counts.steps += 1
            spans.extend(built)
        if not spans:
            return
        self.counts.spans += len(spans)
        readable = readable_spans(spans, self.resource)
        if self.sender is not None:
            self.sender.submit(readable, force=True)  # bounded by step(): no ring read while the queue is full
            return
        try:
            self.jsonl.write(request_json(readable))
            self.chrome.write(spans)
            self.counts.written += len(spans)
        except OSError as exc:
            self._drop("write_failed", len(spans), f"cannot write the trace files in {self.config.folder}: {exc}")
        dropped = self.dropped_total()
        if dropped != self._shown_drops:
            self._shown_drops = dropped
            try:
                self.chrome.counter("obs.dropped_spans", spans[-1].end_ns, dropped)
            except OSError:
                pass

    def _count_gap(self, step: int) -> None:
        """Selected steps that never arrived (overwritten in the ring before they were read) are lost steps."""
        last, self._last_step = self._last_step, step
        if last is None or step <= last + 1:
            return
        gap = range(last + 1, step)
        self.lost_steps += len(gap) if len(gap) > 100_000 else sum(map(self.selection.selected, gap))

    def _drop(self, why: str, n: int, message: str) -> None:
        if not self.counts.dropped.get(why):
            self.notes.append(message)
        self.counts.dropped[why] = self.counts.dropped.get(why, 0) + n

    def dropped(self) -> dict[str, int]:
        out = dict(self.counts.dropped)
        if self.lost_steps:  # estimated: the lost steps' spans, at the exported steps' mean
            per_step = self.counts.spans / self.counts.steps if self.counts.steps else 5.0
            out["ring_overrun"] = round(self.lost_steps * per_step)
        if self.sender is not None:
            for key, value in self.sender.dropped.items():
                out[key] = out.get(key, 0) + value
        return {k: v for k, v in out.items() if v}

    def dropped_total(self) -> int:
        return sum(self.dropped().values())

    def _status_path(self) -> str:
        return os.path.join(self.config.folder, f"status_{self.config.trainer_pid}.json")

    def _previous(self) -> list[dict[str, Any]]:
        """The statuses of this trainer's earlier sessions in the folder (their exporters ended: see ``after``), kept
        in ``previous``: the status file is per trainer process, and a hot reload may restart its session."""
        if not self.config.after:
            return []
        from obs._core.json_files import read_json

        try:
            earlier = read_json(self._status_path(), what="an exporter's status file")
        except (OSError, ValueError):
            return []
        if earlier.get("ring") not in self.config.after:
            return []
        before = earlier.pop("previous", None)
        return [*(before if isinstance(before, list) else []), earlier]

    def status(self, *, done: bool) -> dict[str, Any]:
        files = [] if self.jsonl is None else self.jsonl.file.written + self.chrome.file.written
        return {"done": done, "trainer_pid": self.config.trainer_pid, "ring": self.config.ring, "rank": self.rank,
                "run_id": self.run_id, "endpoint": self.endpoint, "protocol": self.protocol if self.endpoint else "",
                "files": files, "steps": self.counts.steps, "spans": self.counts.spans,
                "exported": self.sender.exported if self.sender is not None else self.counts.written,
                "dropped": self.dropped(), "last_error": getattr(self.sender, "last_error", ""),
                "ring_overrun": {"steps": self.lost_steps, "events": sum(self.follower.lost.values())},
                "metrics": self.metrics.status() if self.metrics is not None else None,
                "notes": self.notes + (self.metrics.notes if self.metrics is not None else []),
                "summary": self.summary.result(dropped=self.dropped(), endpoint=self.endpoint).as_dict(),
                "previous": self.previous}

    def write_status(self, *, done: bool) -> None:
        from obs._core import safe_files

        safe_files.write_atomic(self._status_path(), json.dumps(self.status(done=done), indent=1), fsync=done)

    def close(self) -> None:
        if self.target is not None:
            self.target.remove()  # first: Prometheus stops scraping the rank before its endpoint closes
        if self.sender is not None:
            self.sender.close(self.config.flush_deadline_s)
        if self.metrics is not None:
            self.metrics.close(self.config.flush_deadline_s)
        for writer in (self.jsonl, self.chrome):
            if writer is not None:
                writer.close()
        self.write_status(done=True)
        self.follower.close()
        if not self.config.keep_ring:
            try:
                os.unlink(self.config.ring)
            except FileNotFoundError:
                pass


def run(config: ExportConfig, alive: Callable[[float], bool]) -> Exporter:
    """Export until ``alive(timeout)`` (which waits up to ``timeout`` seconds) says the trainer is gone."""
    deadline = time.monotonic() + _AFTER_WAIT_S
    while any(os.path.exists(ring) for ring in config.after) and time.monotonic() < deadline:
        time.sleep(config.poll_s)  # the trainer's ring holds what it writes meanwhile
    exporter = Exporter(config)
    last_status = time.monotonic()
    while alive(config.poll_s):
        exporter.step()
        if time.monotonic() - last_status > 2.0:
            exporter.write_status(done=False)
            last_status = time.monotonic()
    exporter.step(final=True)  # what was written before the end, settled or not
    exporter.close()
    return exporter


def _trainer_alive(trainer_pid: int) -> Callable[[float], bool]:
    """Alive while stdin (the trainer's pipe) is open and the trainer is still our parent."""
    state = {"open": True}

    def alive(timeout: float) -> bool:
        if not state["open"]:
            return False
        ready, _, _ = select.select([0], [], [], timeout)
        if ready and not os.read(0, 4096):
            state["open"] = False
        if trainer_pid and os.getppid() != trainer_pid:
            state["open"] = False
        return state["open"]

    return alive


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--config":
        print("usage: python -m exporters --config JSON", file=sys.stderr)
        return 2
    config = ExportConfig.from_json(args[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; we end when it does
    try:
        os.nice(10)  # training comes first where both want a core; the ring absorbs our delays
    except OSError:
        pass
    stop = {"term": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("term", True))
    alive = _trainer_alive(config.trainer_pid)
    exporter = run(config, lambda timeout: not stop["term"] and alive(timeout))
    for note in exporter.notes + (exporter.metrics.notes if exporter.metrics is not None else []):
        print(f"obs profiler: {note}", file=sys.stderr)
    return 0

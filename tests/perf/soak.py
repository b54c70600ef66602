"""Soak: a tiny model for 1,000,000 steps with the RDR at module level and the profiler at the always-on level,
exporting to a local OTLP receiver, with a capture window every 100,000 steps.

Run: python tests/perf/soak.py [--steps 1000000] [--step-ms 1] [--out soak.json] [--plot soak-rss.png] [--quick]
Budgets (issue "Weeks, not minutes"): RSS growth <= 1 MiB per 100,000 steps in each process (the trainer and its
exporter); descriptors constant; disk bounded by the settings; 0 drops while the backend is up.

The trainer is a child process (``--child``), pinned to one core with one torch thread, a step at most every
``--step-ms`` (1 ms: more steps per second than real training has); its exporter process runs off that core (as the
profiler places it), with this process: the receiver (the tests' OTLP/HTTP receiver, counting instead of keeping)
and a metrics sink (OTLP/HTTP metrics every 5 s), on threads here.  The trainer prints its step every 1/200 of
the steps; at each line this process reads the trainer's and the exporter's resident size, CPU time and open
descriptors (``/proc``), the disk used under the output folders, the rings' wrap-arounds (the highest ``idx`` of
each slot ring over its capacity) and the exporter's status file (its drops).  Windows alternate: odd ones edited
into the env config's ``profiler.window`` half a period ahead (hot reload, ``task_trace``), even ones asked with
``obs trace capture --level op_trace`` as the trainer passes the step; module spans must arrive for exactly the
windows' steps, op spans for exactly the captures'.

- RSS growth: the least-squares slope of each process's RSS after the first 5% of the steps (50,000 of 1,000,000:
  the rings' pages are touched once, the heaps warm up), in MiB per 100,000 steps.
- Descriptors constant: after the warm-up each process's count moves by one at most (a request in flight).
- Disk bounded: what the output folders hold stays within the rings' files (their size is the settings') + 1 MiB.
- No drops: the exporter's status counts no drop and no ring overrun, every step's span arrived once, and the
  receiver got every span the exporter built.
"""

from __future__ import annotations

import argparse
import glob
import http.server
import itertools
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

PHASES = {"data", "forward", "backward", "optimizer"}
WINDOW_STEPS = 5
RSS_BUDGET_MIB = 1.0  # per 100,000 steps, per process


# -- the trainer ------------------------------------------------------------------------------------------------------

def child(config: str, steps: int, report_every: int, step_ms: float) -> None:
    """Train the tiny model for ``steps`` steps under ``config``, a step at most every ``step_ms``; print
    ``step monotonic_s`` every ``report_every`` steps, then ``end`` and wait for a line on stdin before ending."""
    import torch

    import obs

    torch.set_num_threads(1)
    obs.set_context(env_config_path=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    print("started", os.getpid(), flush=True)
    pace, due = step_ms / 1000, time.monotonic()
    for step, (x, y) in enumerate(obs.steps(itertools.repeat(batch, steps)), start=1):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        obs.scalar("loss", loss)
        if step % report_every == 0:
            print(step, time.monotonic(), flush=True)
        if pace:
            due += pace
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                due -= wait  # behind: no burst to catch up
    print("end", flush=True)
    sys.stdin.readline()  # the last reading is taken with everything still running
    obs.reset_context()  # the session ends: its exporter drains the ring and writes its final status


# -- what the backend receives ----------------------------------------------------------------------------------------

def _receiver_class() -> Any:
    from tests.exporters.receiver import Receiver, attr_value

    class CountingReceiver(Receiver):  # type: ignore[misc]
        """The tests' OTLP receiver, counting what arrives instead of keeping it (millions of spans)."""

        def __init__(self, steps: int) -> None:
            super().__init__()
            self.step_seen = bytearray(steps + 2)  # step spans per step (255 at most: a duplicate shows as 2)
            self.spans = 0
            self.step_spans = 0
            self.other = 0  # spans that belong to no step received (their step span came in another request)
            self.module_steps: set[int] = set()
            self.module_spans: dict[int, int] = {}  # per step: module spans received (window steps only)
            self.op_steps: set[int] = set()
            self.requests_n = 0

        def _record(self, request: Any, headers: dict[str, str], path: str) -> None:
            with self._lock:
                self.requests_n += 1
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        step_of: dict[bytes, int] = {}
                        detail = []
                        for s in ss.spans:
                            self.spans += 1
                            if s.name == "step":
                                step = next(attr_value(a.value) for a in s.attributes if a.key == "ml.step")
                                step_of[s.trace_id] = step
                                self.step_spans += 1
                                if 0 <= step < len(self.step_seen):
                                    self.step_seen[step] = min(255, self.step_seen[step] + 1)
                            elif s.name not in PHASES:
                                detail.append(s)
                        for s in detail:
                            keys = {a.key for a in s.attributes}
                            step = step_of.get(s.trace_id)
                            if step is None:
                                self.other += 1
                            elif "ml.op.name" in keys:
                                self.op_steps.add(step)
                            elif "ml.module.scope" in keys:
                                self.module_steps.add(step)
                                self.module_spans[step] = self.module_spans.get(step, 0) + 1

    return CountingReceiver


class MetricsSink:
    """OTLP/HTTP metrics (``/v1/metrics``): counts requests and data points, keeps the last cumulative count of the
    ``obs.step.duration`` histogram.  The tests' receiver takes traces only."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

        owner = self
        self.requests = 0
        self.points = 0
        self.step_count = 0  # the obs.step.duration histogram's count in the last request that had it
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportMetricsServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                owner._count(request)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="soak-metrics", daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics"

    def _count(self, request: Any) -> None:
        with self._lock:
            self.requests += 1
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        points = getattr(metric, kind).data_points if kind else []
                        self.points += len(points)
                        if metric.name == "obs.step.duration":
                            self.step_count = sum(p.count for p in points)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


# -- readings -----------------------------------------------------------------------------------------------------

def proc_reading(pid: int) -> dict[str, float] | None:
    """Resident size (KiB: VmRSS, RssAnon) and open descriptors of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/stat") as fh:
            ticks = fh.read().rsplit(")", 1)[1].split()[11:13]  # utime, stime
    except (FileNotFoundError, ProcessLookupError):
        return None
    kib = {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon") if k in fields}
    return {"rss_kib": kib.get("VmRSS", 0), "anon_kib": kib.get("RssAnon", 0), "fds": fds,
            "cpu_s": round(sum(map(int, ticks)) / os.sysconf("SC_CLK_TCK"), 2)}


def exporter_of(trainer: int) -> int | None:
    """The trainer's exporter process (``python -m exporters``), among its children."""
    try:
        children = []
        for task in os.listdir(f"/proc/{trainer}/task"):
            with open(f"/proc/{trainer}/task/{task}/children") as fh:
                children += [int(p) for p in fh.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return None
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"\0exporters\0" in fh.read():
                    return pid
        except FileNotFoundError:
            continue
    return None


def disk_bytes(folder: str) -> int:
    """Bytes allocated on disk under ``folder`` (st_blocks: a ring is allocated whole when it is made)."""
    total = 0
    for base, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def ring_reading(path: str) -> dict[str, Any]:
    """Per slot ring of ring file ``path``: its capacity, the highest idx written and the wrap-arounds."""
    import numpy as np

    from recorder.ring_reader import SLOT_DTYPE, read_header_file

    header = read_header_file(path)
    out: dict[str, Any] = {}
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for region in header.rings:
            idx = int(np.frombuffer(mm, SLOT_DTYPE, region.capacity, region.offset)["idx"].max())
            out[region.name] = {"capacity": region.capacity, "idx": idx, "wraps": idx // region.capacity}
    out["_file_bytes"] = os.path.getsize(path)
    return out


def read_status(folder: str) -> dict[str, Any] | None:
    """The exporter's status file (written every 2 s, and at its end)."""
    found = sorted(glob.glob(os.path.join(folder, "rank_*", "status_*.json")))
    if not found:
        return None
    try:
        with open(found[-1]) as fh:
            data: dict[str, Any] = json.load(fh)
            return data
    except (OSError, ValueError):
        return None  # being replaced (written atomically, but a reader may race the rename on some systems)


def slope_per_100k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (step, MiB) in MiB per 100,000 steps."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    return sxy / sxx * 100_000 if sxx else None


def plot(samples: list[dict[str, Any]], path: str, title: str, warm: int) -> str:
    """RSS of each process against steps (one panel each, with the budget's slope from the end of the warm-up), as a
    small PNG; '' when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    for ax, key in zip(axes, ("trainer", "exporter")):
        rows = [s for s in samples if s.get(key)]
        xs = [s["step"] / 1000 for s in rows]
        ax.plot(xs, [s[key]["rss_kib"] / 1024 for s in rows], label="RSS", lw=1.2)
        ax.plot(xs, [s[key]["anon_kib"] / 1024 for s in rows], label="anonymous", lw=1.0, ls="--")
        start = next((s for s in rows if s["step"] >= warm), None)
        if start is not None:
            x0, y0 = start["step"], start[key]["rss_kib"] / 1024
            x1 = rows[-1]["step"]
            ax.plot([x0 / 1000, x1 / 1000], [y0, y0 + RSS_BUDGET_MIB * (x1 - x0) / 100_000], color="grey", lw=0.8,
                    ls=":", label=f"budget: +{RSS_BUDGET_MIB:g} MiB / 100k steps")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("thousand steps")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, pil_kwargs={"optimize": True})
    plt.close(fig)
    return ""


# -- the soak -----------------------------------------------------------------------------------------------------

class Soak:
    def __init__(self, steps: int, tmp: str, step_ms: float) -> None:
        self.steps, self.step_ms = steps, step_ms
        self.every = max(10, steps // 10)  # a window every 100,000 steps of 1,000,000
        self.report_every = max(1, steps // 200)
        self.every -= self.every % self.report_every  # windows are planned at the trainer's report lines
        self.tmp = tmp
        self.rdr, self.prof = os.path.join(tmp, "rdr"), os.path.join(tmp, "prof")
        self.config = os.path.join(tmp, "obs.json")
        self.windows: list[dict[str, Any]] = []
        self.captures: list[tuple[dict[str, Any], subprocess.Popen[str]]] = []
        self.samples: list[dict[str, Any]] = []
        self.pids: dict[str, list[int]] = {"trainer": [], "exporter": []}
        self.drops_seen: list[dict[str, Any]] = []

    def write_config(self, window: dict[str, Any] | None = None) -> None:
        body = {"rdr": {"enable": True, "path": self.rdr, "granularity": "module"},
                "profiler": {"enable": True, "options": "training_trace", "output": self.prof, "metrics": "otlp",
                             "window": window or {}}}
        part = self.config + ".tmp"
        with open(part, "w") as fh:
            json.dump(body, fh)
        os.replace(part, self.config)  # the watcher sees one whole file

    def plan(self, step: int) -> None:
        """At a report line: windows to announce (config) or ask for (obs trace capture), captures answered."""
        for k in range(1, (self.steps - 1) // self.every + 1):
            at = k * self.every
            if k % 2 == 1 and not any(w["k"] == k for w in self.windows) and step >= at - self.every // 2:
                window = {"start": at, "steps": WINDOW_STEPS, "level": "task_trace"}
                self.write_config(window)
                self.windows.append({"k": k, "how": "profiler.window (hot reload)", "level": "task_trace",
                                     "steps": [at, at + WINDOW_STEPS - 1], "written_at_step": step})
            elif k % 2 == 0 and not any(w["k"] == k for w in self.windows) and step >= at:
                cmd = [sys.executable, "-m", "obs", "trace", "capture", self.prof, "--steps", str(WINDOW_STEPS),
                       "--level", "op_trace", "--timeout", "30", "--json"]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                        env={**os.environ, "PYTHONPATH": ROOT})
                window = {"k": k, "how": "obs trace capture", "level": "op_trace", "steps": None,
                          "asked_at_step": step}
                self.windows.append(window)
                self.captures.append((window, proc))
        for window, proc in list(self.captures):
            if proc.poll() is not None:
                self.captures.remove((window, proc))
                self._answered(window, proc)

    @staticmethod
    def _answered(window: dict[str, Any], proc: subprocess.Popen[str]) -> None:
        out, err = proc.communicate()
        try:
            answer = json.loads(out)
            (row,) = answer["ranks"]
            window["steps"] = row.get("steps")
            window["answer"] = {k: row.get(k) for k in ("steps", "queued", "error") if row.get(k) is not None}
        except (ValueError, KeyError, TypeError) as exc:
            window["error"] = f"{type(exc).__name__}: {exc}; {err.strip()[-300:]}"

    def sample(self, step: int, now: float, trainer: int) -> None:
        exporter = exporter_of(trainer)
        if exporter is not None and exporter not in self.pids["exporter"]:
            self.pids["exporter"].append(exporter)
        rings = {}
        for name, pattern in (("profile", os.path.join(self.prof, "rank_*", "profile_*.obsring")),
                              ("rdr", os.path.join(self.rdr, "rank_*", "rdr", "ring_*.obsring"))):
            for path in glob.glob(pattern):
                try:
                    rings[name] = ring_reading(path)
                except (OSError, ValueError):
                    pass
        status = read_status(self.prof)
        dropped = dict((status or {}).get("dropped") or {})
        self.samples.append({
            "step": step, "t": round(now, 3), "lag_s": round(time.monotonic() - now, 3),
            "trainer": proc_reading(trainer),
            "exporter": proc_reading(exporter) if exporter is not None else None,
            "disk_bytes": disk_bytes(self.rdr) + disk_bytes(self.prof),
            "rings": {n: {r: v["wraps"] for r, v in reading.items() if isinstance(v, dict)}
                      for n, reading in rings.items()},
            "ring_bytes": sum(r["_file_bytes"] for r in rings.values()),
            "exported": (status or {}).get("exported"), "dropped": dropped,
            "ring_overrun": (status or {}).get("ring_overrun")})
        if dropped or ((status or {}).get("ring_overrun") or {}).get("events"):
            self.drops_seen.append({"step": step, "dropped": dropped,
                                    "ring_overrun": (status or {}).get("ring_overrun")})

    def run(self, pin: bool) -> dict[str, Any]:
        receiver = _receiver_class()(self.steps)
        traces_url = receiver.start_http() + "/v1/traces"
        sink = MetricsSink()
        self.write_config()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MS_", "MINDSPORE_", "OBS_", "OTEL_")) or k.startswith("OBS_NATIVE")}
        env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=traces_url,
                   OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=sink.url, OTEL_METRIC_EXPORT_INTERVAL="5000")
        cores = sorted(os.sched_getaffinity(0))
        cmd = [sys.executable, __file__, "--child", self.config, "--steps", str(self.steps),
               "--report-every", str(self.report_every), "--step-ms", str(self.step_ms)]
        if pin and len(cores) > 1:
            cmd = ["taskset", "-c", str(cores[-1]), *cmd]  # the exporter goes to the other cores, with us
            os.sched_setaffinity(0, set(cores[:-1]))
        load_before = os.getloadavg()
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=self.tmp)
        try:
            os.nice(10)  # the receiver stands for a collector elsewhere: no precedence over the (niced) exporter
        except OSError:
            pass
        err_lines: list[str] = []
        err_thread = threading.Thread(target=lambda: err_lines.extend(proc.stderr or []), daemon=True)
        err_thread.start()
        trainer, first, last = 0, (0, 0.0), (0, 0.0)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                parts = line.split()
                if parts[:1] == ["started"]:
                    trainer = int(parts[1])
                    self.pids["trainer"].append(trainer)
                    continue
                if parts[:1] == ["end"]:
                    assert proc.stdin is not None
                    proc.stdin.write("\n")
                    proc.stdin.close()
                    continue
                if len(parts) != 2:
                    continue
                step, t = int(parts[0]), float(parts[1])
                if not first[1]:
                    first = (step, t)
                last = (step, t)
                self.sample(step, t, trainer)
                self.plan(step)
                if step % (self.report_every * 20) == 0:
                    s = self.samples[-1]
                    print(f"step {step:>9,}  trainer {s['trainer']['rss_kib'] / 1024:7.1f} MiB  exporter "
                          f"{(s['exporter'] or {}).get('rss_kib', 0) / 1024:7.1f} MiB  fds "
                          f"{s['trainer']['fds']}/{(s['exporter'] or {}).get('fds')}  "
                          f"exported {s['exported']}  dropped {s['dropped']}", file=sys.stderr, flush=True)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for _, capture in self.captures:
                capture.kill()
            err_thread.join(5)
        wall = time.monotonic() - started
        for window, capture in self.captures:
            self._answered(window, capture)
        time.sleep(1.0)  # the last metrics export and spans are answered by now (the exporter has ended)
        receiver.stop()
        sink.stop()
        final = read_status(self.prof) or {}
        return self.result(receiver, sink, final, proc.returncode, "".join(err_lines[-40:]), wall, first, last,
                           load_before)

    def result(self, receiver: Any, sink: MetricsSink, final: dict[str, Any], code: int | None, err: str,
               wall: float, first: tuple[int, float], last: tuple[int, float], load_before: tuple[float, ...]
               ) -> dict[str, Any]:
        warm = self.steps // 20
        processes: dict[str, Any] = {}
        for key in ("trainer", "exporter"):
            rows = [(s["step"], s[key]) for s in self.samples if s.get(key)]
            after = [(st, r) for st, r in rows if st >= warm]
            if not rows:
                processes[key] = None
                continue
            fds = [r["fds"] for _, r in after] or [r["fds"] for _, r in rows]
            processes[key] = {
                "pids": self.pids[key],
                "rss_mib": {"first": round(rows[0][1]["rss_kib"] / 1024, 2),
                            "at_warm_up_end": round(after[0][1]["rss_kib"] / 1024, 2) if after else None,
                            "last": round(rows[-1][1]["rss_kib"] / 1024, 2),
                            "max": round(max(r["rss_kib"] for _, r in rows) / 1024, 2)},
                "rss_slope_mib_per_100k": _round(slope_per_100k([(st, r["rss_kib"] / 1024) for st, r in after])),
                "anon_slope_mib_per_100k": _round(slope_per_100k([(st, r["anon_kib"] / 1024) for st, r in after])),
                "fds": {"first": rows[0][1]["fds"], "last": rows[-1][1]["fds"], "min_after_warm_up": min(fds),
                        "max_after_warm_up": max(fds), "values_after_warm_up": sorted(set(fds))},
            }
        disk = [s["disk_bytes"] for s in self.samples]
        ring_bytes = max((s["ring_bytes"] for s in self.samples), default=0)
        seen = receiver.step_seen[1:self.steps + 1]
        missing = seen.count(0)
        duplicated = sum(1 for v in seen if v > 1)
        want_module = set()
        want_op = set()
        for w in self.windows:
            if w.get("steps"):
                span = set(range(w["steps"][0], w["steps"][1] + 1))
                want_module |= span
                if w["level"] == "op_trace":
                    want_op |= span
        dropped_total = sum((final.get("dropped") or {}).values())
        overrun = (final.get("ring_overrun") or {}).get("events", 0)
        budgets = {
            "rss_trainer": _budget(processes["trainer"], RSS_BUDGET_MIB),
            "rss_exporter": _budget(processes["exporter"], RSS_BUDGET_MIB),
            # constant: after warm-up the count moves by one at most (a request to the receiver in flight)
            "fds_constant": all(p is not None and p["fds"]["max_after_warm_up"] - p["fds"]["min_after_warm_up"] <= 1
                                for p in processes.values()),
            "disk_bounded": bool(disk) and max(disk) <= ring_bytes + (1 << 20),
            "no_drops": dropped_total == 0 and overrun == 0 and not self.drops_seen and missing == 0
            and receiver.spans == final.get("spans"),
            "windows_exact": receiver.module_steps == want_module and receiver.op_steps == want_op
            and all(w.get("steps") for w in self.windows),
        }
        last_rings = self.samples[-1]["rings"] if self.samples else {}
        return {
            "benchmark": "soak", "steps": self.steps, "exit_code": code, "trainer_stderr_tail": err[-3000:] if code
            else "", "python": platform.python_version(), "machine": platform.machine(),
            "cores": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(wall, 1), "soak_process_cpu_s": round(sum(os.times()[:2]), 1),
            "steps_per_s": round((last[0] - first[0]) / (last[1] - first[1]), 1) if last[1] > first[1] else None,
            "settings": {"rdr": "module", "profiler": "training_trace", "metrics": "otlp (every 5 s)",
                         "window_every": self.every, "window_steps": WINDOW_STEPS, "warm_up_steps": warm,
                         "sample_every": self.report_every},
            "budgets": budgets, "processes": processes,
            "disk": {"first_bytes": disk[0] if disk else None, "max_bytes": max(disk) if disk else None,
                     "last_bytes": disk[-1] if disk else None, "ring_files_bytes": ring_bytes},
            "ring_wraps": last_rings,
            "exporter_status": {k: final.get(k) for k in ("steps", "spans", "exported", "dropped", "ring_overrun",
                                                          "last_error", "metrics", "notes")},
            "received": {"spans": receiver.spans, "step_spans": receiver.step_spans, "requests": receiver.requests_n,
                         "steps_missing": missing, "steps_duplicated": duplicated,
                         "missing_ranges": _ranges(i + 1 for i, v in enumerate(seen) if not v),
                         "unmatched_detail": receiver.other,
                         "module_steps": sorted(receiver.module_steps), "op_steps": sorted(receiver.op_steps),
                         "module_spans_per_step": sorted(receiver.module_spans.items()),
                         "metric_requests": sink.requests, "metric_points": sink.points,
                         "metric_step_count": sink.step_count},
            "expected": {"step_spans": self.steps, "spans": final.get("spans"), "module_steps": sorted(want_module),
                         "op_steps": sorted(want_op)},
            "windows": self.windows, "drops_seen": self.drops_seen, "samples": self.samples,
        }


def _ranges(numbers: Any, shown: int = 50) -> list[list[int]]:
    """Sorted numbers as [first, last] runs (the first ``shown`` runs)."""
    out: list[list[int]] = []
    for n in numbers:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        elif len(out) < shown:
            out.append([n, n])
        else:
            break
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _budget(process: dict[str, Any] | None, limit: float) -> bool:
    return process is not None and process["rss_slope_mib_per_100k"] is not None and \
        process["rss_slope_mib_per_100k"] <= limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 20,000 steps")
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--plot", default="soak-rss.png", help="PNG of RSS against steps ('' for none)")
    parser.add_argument("--step-ms", type=float, default=1.0, help="a step at most every this many ms (0: as fast as "
                        "it goes; default 1: at most 1,000 steps/s, more than real training has)")
    parser.add_argument("--no-pin", action="store_true", help="leave the trainer unpinned")
    parser.add_argument("--keep", action="store_true", help="keep the output folders (printed)")
    parser.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("--report-every", type=int, default=5000, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.report_every, args.step_ms)
        return
    steps = 20_000 if args.quick else args.steps
    tmp = tempfile.mkdtemp(prefix="obs-soak-")
    try:
        data = Soak(steps, tmp, args.step_ms).run(pin=not args.no_pin)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.quick:
        data["note"] = ("a smoke run: too few steps to judge the RSS budgets (a one-off page-in, such as the code the "
                        "first op_trace window loads, reads as growth)")
    if args.plot:
        why = plot(data["samples"], args.plot, f"soak: {steps:,} steps, RDR module + profiler training_trace, OTLP",
                   data["settings"]["warm_up_steps"])
        data["plot"] = why or args.plot
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=1)
    summary = {k: data[k] for k in ("steps", "wall_s", "steps_per_s", "budgets", "ring_wraps", "disk")}
    summary["rss_slopes"] = {k: v and v["rss_slope_mib_per_100k"] for k, v in data["processes"].items()}
    summary["fds"] = {k: v and v["fds"] for k, v in data["processes"].items()}
    summary["received"] = {k: v for k, v in data["received"].items() if not k.endswith("_steps")}
    summary["exporter_status"] = data["exporter_status"]
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""``obs top --prometheus`` at scale: 4,096 ranks held by a real Prometheus.

Run: python tests/perf/bench_prometheus_top.py [--ranks 4096] [--repeats 5] [--scrapes 3] [--hung]
                                               [--out bench-prom-top.json]

Budget: <= 5 s and <= 500 MiB for ``obs top --prometheus URL --once --json`` on 4,096 ranks.

One synthetic target (an HTTP server in this process) serves every rank's series as the exporters would, with the
labels file service discovery gives them (``run_id``, ``rank``, ``node``, ``instance``: 8 ranks a node) and
``honor_labels`` so Prometheus keeps them: the step, step end time, start time, steps/s and the step, phase (data,
forward, backward, optimizer), collectives and memory series, the step histogram's 18 buckets, about 40 series a
rank.  Every rank makes 1.7 steps a second, 0.6 s a step; in synchronous training the others wait for the slowest
in the collectives, so rank ``--slow`` spends 0.2 s more in its data loading and every other rank 0.2 s more in
collectives.  A second, older run of 8 ranks is served too (``obs top`` shows the newest).  Prometheus (the
``prometheus`` binary on PATH or /usr/bin) scrapes it every 15 s (its default); once it holds ``--scrapes``
scrapes of every rank, the command runs ``--repeats`` times (between two scrapes of the synthetic target), each
in a fresh process started by a small launcher whose ``RUSAGE_CHILDREN`` peak RSS is the command's own, and its
output is checked (every rank, the slow rank alone named, in its data loading; with ``--hung``, every rank stuck).
``exporters.prometheus_job.read_job`` is also timed in this process, and each of its queries alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from exporters.metrics import DURATION_BUCKETS_S  # noqa: E402 - after the path
from exporters.prometheus_job import read_job  # noqa: E402
from exporters.promql import Prometheus  # noqa: E402

STEP_S, SLOW_S = 0.6, 0.2  # a step of every rank (the others wait for the slow one), the slow rank's extra
PHASES = {"data": 0.02, "forward": 0.08, "backward": 0.2, "optimizer": 0.02}
_LAUNCHER = ("import resource, subprocess, sys, time\n"
             "t = time.perf_counter()\n"
             "done = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
             "wall = time.perf_counter() - t\n"
             "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
             "sys.stderr.write(done.stderr.decode())\n"
             "sys.stdout.write(f'{done.returncode} {wall} {peak}\\n' + done.stdout.decode())\n")


class Job:
    """The series of ``ranks`` ranks of run ``run_id`` at a time since ``start`` (counters grow with it)."""

    def __init__(self, run_id: str, ranks: int, slow: int, start: float, hung_at: float | None = None) -> None:
        self.ranks, self.slow, self.start, self.hung_at = ranks, slow, start, hung_at
        self.labels = [f'run_id="{run_id}",rank="{r}",node="node{r // 8}",instance="node{r // 8}:{9464 + r % 8}",'
                       f'ml_rank="{r}"' for r in range(ranks)]

    def render(self, now: float, out: list[str]) -> None:
        elapsed = min(now, self.hung_at or now) - self.start  # a hung job's series stay as they were
        steps = int(elapsed / STEP_S)
        step = STEP_S
        le = [b for b in DURATION_BUCKETS_S] + [float("inf")]
        for r, labels in enumerate(self.labels):
            slow = r == self.slow
            coll = 0.05 if slow else 0.05 + SLOW_S
            n = steps
            out.append(f"obs_step{{{labels}}} {n}")
            out.append(f"obs_step_end_time_seconds{{{labels}}} {self.start + n * STEP_S:.3f}")
            out.append(f"obs_start_time_seconds{{{labels}}} {self.start:.3f}")
            out.append(f"obs_steps_per_second{{{labels}}} {1 / step:.4f}")
            out.append(f"obs_memory_used_bytes{{{labels},device=\"cuda:{r % 8}\"}} {30 * 2**30}")
            out.append(f"obs_memory_peak_bytes{{{labels},device=\"cuda:{r % 8}\"}} {36 * 2**30}")
            out.append(f"obs_nonfinite_findings_total{{{labels}}} 0")
            for bound in le:
                text = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f"obs_step_duration_seconds_bucket{{{labels},le=\"{text}\"}} {n if bound >= step else 0}")
            out.append(f"obs_step_duration_seconds_sum{{{labels}}} {n * step:.3f}")
            out.append(f"obs_step_duration_seconds_count{{{labels}}} {n}")
            out.append(f"obs_step_collectives_duration_seconds_sum{{{labels}}} {n * coll:.3f}")
            out.append(f"obs_step_collectives_duration_seconds_count{{{labels}}} {n}")
            for phase, took in PHASES.items():
                took += SLOW_S if (phase == "data" and slow) or (phase == "backward" and not slow) else 0.0
                out.append(f"obs_step_phase_duration_seconds_sum{{{labels},phase=\"{phase}\"}} {n * took:.3f}")
                out.append(f"obs_step_phase_duration_seconds_count{{{labels},phase=\"{phase}\"}} {n}")


SERVED = [0.0]  # when the synthetic target last finished a scrape (monotonic)


def serve(jobs: list[Job]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            lines: list[str] = []
            for job in jobs:
                job.render(time.time(), lines)
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            SERVED[0] = time.monotonic()


        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def between_scrapes() -> None:
    """Wait until a scrape ended 3 s ago (Prometheus has stored it) and the next is 12 s away: the synthetic target's
    rendering and Prometheus' ingestion of its 150,000 series, costs of this bench and not of a real job's view,
    do not share the 2 cores with the run measured."""
    while not 3.0 <= time.monotonic() - SERVED[0] <= 5.0:
        time.sleep(0.1)


def instant(url: str, expr: str) -> float:
    reply = json.loads(urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}),
                                              timeout=30).read())
    result = reply["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--slow", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scrapes", type=int, default=3, help="scrapes Prometheus holds before the runs")
    parser.add_argument("--hung", action="store_true", help="every rank finished its last step 10 min ago (the view "
                        "then reads every rank's step histogram for its stuck threshold: the costliest case)")
    parser.add_argument("--out", default="bench-prom-top.json")
    args = parser.parse_args()
    binary = next((p for p in (shutil.which("prometheus"), "/usr/bin/prometheus") if p and os.access(p, os.X_OK)),
                  None)
    if binary is None:
        print("no prometheus binary (apt-get install prometheus)", file=sys.stderr)
        return 2
    start = time.time()
    jobs = [Job("older", 8, -1, start - 3600),
            Job("bench", args.ranks, args.slow % args.ranks, start - 1200, start - 600 if args.hung else None)]
    server, thread = serve(jobs)
    folder = tempfile.mkdtemp(prefix="bench-prom-top-")
    web = f"http://127.0.0.1:{_free_port()}"
    config = os.path.join(folder, "prometheus.yml")
    with open(config, "w") as fh:
        fh.write("global:\n  scrape_interval: 15s\n  scrape_timeout: 10s\nscrape_configs:\n  - job_name: obs\n"
                 "    honor_labels: true\n    static_configs:\n"
                 f"      - targets: ['127.0.0.1:{server.server_address[1]}']\n")
    log = open(os.path.join(folder, "prometheus.log"), "w")
    prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder}/tsdb",
                             f"--web.listen-address={web[len('http://'):]}"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    result: dict[str, Any] = {"ranks": args.ranks, "hung": args.hung, "python": platform.python_version(),
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    try:
        sel = 'run_id="bench"'
        deadline = time.monotonic() + 300
        want = args.ranks
        while time.monotonic() < deadline:
            try:
                held = instant(web, f"count(count_over_time(obs_step{{{sel}}}[1m]) >= {args.scrapes})")
                series = instant(web, 'count({__name__=~"obs_.+"})')
            except OSError:
                held = series = 0.0
            if held >= want:
                break
            time.sleep(1.0)
        else:
            raise SystemExit(f"Prometheus did not hold the ranks' scrapes in time (see {folder}/prometheus.log)")
        result["series"] = int(series)
        runs = []
        for _ in range(args.repeats):
            between_scrapes()
            done = subprocess.run([sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "obs", "top",
                                   "--prometheus", web, "--once", "--json"], capture_output=True, text=True,
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
            head, _, body = done.stdout.partition("\n")
            code, wall, peak_kib = head.split()
            doc = json.loads(body)
            assert code == "0", done.stderr
            assert len(doc["ranks"]) == args.ranks and doc["run_id"] == "bench", doc.get("run_id")
            slow = args.slow % args.ranks
            if args.hung:
                assert doc["stuck"] == doc["waited_for"] == list(range(args.ranks)), doc["stuck"][:10]
            else:
                assert doc["waited_for"] == [slow], doc["waited_for"]
                assert doc["ranks"][slow]["late_phase"] == "data" and doc["ranks"][slow]["memory_used_bytes"]
            runs.append({"wall_s": float(wall), "peak_rss_mib": int(peak_kib) / 1024, "queries": doc["queries"]})
        result["cli"] = runs
        result["cli_wall_s"] = statistics.median(r["wall_s"] for r in runs)
        result["cli_peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
        result["cli_wall_max_s"] = max(r["wall_s"] for r in runs)
        inproc = []
        for _ in range(args.repeats):
            between_scrapes()
            t = time.perf_counter()
            job = read_job(Prometheus(web))
            inproc.append(time.perf_counter() - t)
            assert len(job.ranks) == args.ranks
        result["read_job_s"] = statistics.median(inproc)
        result["per_query"] = per_query(web)
    finally:
        os.killpg(prom.pid, signal.SIGTERM)
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(prom.pid, signal.SIGKILL)
        log.close()
        server.shutdown()
        server.server_close()
        thread.join(5)
        shutil.rmtree(folder, ignore_errors=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{'ranks':>6} {'series':>8} {'queries':>7} {'obs top wall (median)':>22} {'peak RSS':>9} "
          f"{'read_job in-process':>20}")
    print(f"{args.ranks:>6} {result['series']:>8} {runs[0]['queries']:>7} {result['cli_wall_s']:>20.2f} s "
          f"{result['cli_peak_rss_mib']:>5.0f} MiB {result['read_job_s']:>18.2f} s")
    for q in result["per_query"]:
        print(f"  {q['s']:6.2f} s  {q['parse_s']:5.2f} s parse  {q['rows']:6d} rows  {q['mib']:6.2f} MiB  "
              f"{q['query'][:90]}")
    return 0


def per_query(web: str) -> list[dict[str, Any]]:
    """Each of read_job's queries alone, one after the other: Prometheus' time and the reply's size."""
    import exporters.prometheus_job as view

    asked: list[str] = []

    class Recording(Prometheus):
        def query(self, expr: str, *, at: float | None = None) -> Any:
            asked.append(expr)
            return super().query(expr, at=at)

    view.read_job(Recording(web))
    out = []
    for expr in asked:
        form = urllib.parse.urlencode({"query": expr}).encode()
        t = time.perf_counter()
        raw = urllib.request.urlopen(urllib.request.Request(f"{web}/api/v1/query", data=form), timeout=60).read()
        took = time.perf_counter() - t
        t = time.perf_counter()
        rows = len(json.loads(raw)["data"]["result"])
        out.append({"query": expr, "s": round(took, 3), "parse_s": round(time.perf_counter() - t, 3),
                    "rows": rows, "mib": round(len(raw) / 2**20, 2)})
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())

"""``obs top --prometheus`` against a stand-in for Prometheus' query API (an HTTP server in this process answering
each of the view's PromQL queries with canned series): who is late and in which phase, who is stuck, behind or
gone, which run is shown, and the errors.  Against a real Prometheus and a real job: test_prometheus.py."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from exporters.prometheus_job import read_job
from exporters.promql import Prometheus, PromQLError
from obs.cli import main

NOW = 1_800_000_000.0


def series(run: str, rank: int, value: float, **labels: str) -> dict:
    metric = {"run_id": run, "rank": str(rank), "node": f"n{rank // 2}", "instance": f"n{rank // 2}:{9464 + rank % 2}",
              **labels}
    return {"metric": metric, "value": [NOW, repr(value) if value == value else "NaN"]}


def answers(expr: str) -> list[dict]:
    """Run r2 (3 ranks; rank 2 0.3 s slow in its data loading, rank 0 stuck, rank 1 gone) and an older run r1."""
    if expr.startswith("min by (run_id) (obs_start_time_seconds"):
        return [{"metric": {"run_id": "r1"}, "value": [NOW, "1000"]},
                {"metric": {"run_id": "r2"}, "value": [NOW, "2000"]}]
    run = "r1" if 'run_id="r1"' in expr else "r2"
    ranks = range(2) if run == "r1" else range(3)
    if "(obs_step{" in expr:
        return [series(run, r, {0: 90, 1: 100, 2: 100}[r]) for r in ranks]
    if "obs_step_end_time_seconds" in expr:
        return [series(run, r, 900.0 if r == 0 else 0.4) for r in ranks]
    if "(obs_steps_per_second" in expr:
        return [series(run, r, 2.5) for r in ranks]
    if "(up{" in expr:
        return [series(run, r, 0.0 if r == 1 else 1.0) for r in ranks]
    if "histogram_quantile" in expr:
        return [series(run, r, 0.4) for r in ranks]
    if "obs_step_collectives_duration_seconds_sum" in expr:
        return [series(run, r, 0.02 if r == 2 else 0.32) for r in ranks]
    if "obs_step_duration_seconds_sum" in expr:
        return [series(run, r, 0.4) for r in ranks]
    if "obs_step_phase_duration_seconds_sum" in expr:
        phases = {"data": lambda r: 0.31 if r == 2 else 0.01, "forward": lambda r: 0.02,
                  "backward": lambda r: 0.05 if r == 2 else 0.35}
        return [series(run, r, took(r), phase=name) for r in ranks for name, took in phases.items()]
    if "obs_memory_" in expr:
        return [series(run, r, 2.0 ** 30, __name__=f"obs_memory_{kind}_bytes", device="cpu")
                for r in ranks for kind in ("used", "peak")]
    raise AssertionError(f"a query the stand-in does not know: {expr}")


class _Api(BaseHTTPRequestHandler):
    asked: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        expr = form["query"][0]
        _Api.asked.append(expr)
        if "bad(" in expr:
            body, code = {"status": "error", "errorType": "bad_data", "error": "parse error: unexpected"}, 400
        else:
            body, code = {"status": "success", "data": {"resultType": "vector", "result": answers(expr)}}, 200
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_the_newest_run_its_straggler_and_phase_the_stuck_the_gone_and_the_behind(server):
    _Api.asked.clear()
    job = read_job(Prometheus(server), now_s=NOW)
    assert job.run_id == "r2" and job.runs == ["r2", "r1"]
    assert job.queries == len(_Api.asked) == 10  # a fixed number, whatever the number of ranks (+1: a late rank)
    # the median step time asked of the rank without a step for 5 min only
    assert [q for q in _Api.asked if "histogram_quantile" in q and 'rank=~"0"' in q]
    assert all('run_id="r2"' in q for q in _Api.asked[1:])
    zero, one, two = job.ranks
    assert [r.rank for r in job.ranks] == [0, 1, 2] and two.host == "n1" and two.instance == "n1:9464"
    assert two.straggler and two.late_phase == "data" and two.lateness_s == pytest.approx(0.3)
    assert two.busy_s == pytest.approx(0.38) and two.phase_excess_s["data"] == pytest.approx(0.3)
    assert not zero.straggler and not one.straggler
    assert zero.stuck and zero.behind == 10 and not one.stuck and two.behind == 0  # 900 s > max(300, 20 x 0.4)
    assert not one.alive and job.gone == [1] and job.waited_for == [0, 2]
    assert two.memory_used == {"cpu": 2.0 ** 30} and two.steps_per_s == 2.5


def test_a_run_is_picked_by_its_id_and_an_unknown_one_has_no_ranks(server):
    job = read_job(Prometheus(server), "r1", now_s=NOW)
    assert job.run_id == "r1" and [r.rank for r in job.ranks] == [0, 1]
    assert read_job(Prometheus(server), "r9", now_s=NOW).ranks == []


def test_the_cli_table_and_json(server):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["top", "--prometheus", server, "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert doc["source"] == "prometheus" and doc["run_id"] == "r2" and doc["waited_for"] == [0, 2]
    assert doc["ranks"][2]["late_phase"] == "data" and doc["ranks"][2]["step"] == 100 and doc["stuck"] == [0]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["top", "--prometheus", server, "--run", "r2", "--once"]) == 0
    table = out.getvalue()
    assert "straggler in data" in table and "stuck: no step for 900 s" in table and "gone" in table
    assert "the others wait for rank 0: no step for 900 s; rank 2: 300.0 ms per step more" in table


def test_bad_input_is_exit_2_naming_it(server, capsys):
    assert main(["top", "--prometheus", server, "--run", "r9", "--once"]) == 2
    assert "holds no run 'r9' (runs it holds, newest first: r2, r1" in capsys.readouterr().err
    assert main(["top", "--prometheus", server, "--window", "5 minutes"]) == 2
    assert "--window must be a PromQL duration" in capsys.readouterr().err
    assert main(["top", "--prometheus", "ftp://x"]) == 2
    assert "must be an http:// or https:// URL" in capsys.readouterr().err
    assert main(["top", "somewhere", "--prometheus", server]) == 2
    assert main(["top", "--run", "r2"]) == 2
    assert "--run 'r2' needs --prometheus URL" in capsys.readouterr().err


def test_query_errors_name_the_server_and_the_reason(server):
    with pytest.raises(PromQLError, match=r"'bad\(' failed: HTTP 400: parse error: unexpected"):
        Prometheus(server).query("bad(")
    with pytest.raises(PromQLError, match=r"cannot reach Prometheus at http://127\.0\.0\.1:1"):
        Prometheus("http://127.0.0.1:1").query("up")


def test_a_rank_scraped_earlier_is_not_behind_but_a_slower_or_stuck_one_is():
    """Seen on nanoGPT (2 ranks, 60 steps/s, scraped every 2 s): the rank scraped 0.7 s earlier read 44 steps behind."""
    from exporters.prometheus_job import JobSeen, RankSeen, _judge

    def rank(n, step, since_s, rate=60.0):
        return RankSeen(rank=n, host="vm", instance=f"vm:{9464 + n}", step=step, steps_per_s=rate, since_step_s=since_s,
                        median_step_s=1 / 60)

    job = JobSeen(url="", taken_s=0.0, run_id="r", window="1m",
                  ranks=[rank(0, 3617, 0.74), rank(1, 3661, 0.01), rank(2, 3500, 0.02), rank(3, 3000, 900.0)])
    _judge(job)
    assert [r.behind for r in job.ranks] == [0, 0, 160, 661]  # 44 steps in 0.73 s at 60/s: the scrape, not the rank
    assert [r.stuck for r in job.ranks] == [False, False, False, True]

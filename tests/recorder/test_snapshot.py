"""``obs rdr snapshot`` and hangs across ranks: real 2-rank gloo jobs under torchrun (snapshot_script.py), and the
``now`` of a ring and analyze's ``where`` on rings and bundles written here."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from obs.cli import main
from recorder.analyze import analyze
from recorder.assemble import bundle_parts
from recorder.bundle import write_bundle
from recorder.bundle_reader import list_bundles, load_bundle
from recorder.collective_desc import COLLECTIVE_STATES, collective_desc
from recorder.layout import DEFAULT_CAPACITY, Kind
from recorder.now import now, open_collective
from recorder.requests import requests_dir
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring, read_ring_file
from tests.recorder._jobs import finish, free_port, kill_leftovers

SCRIPT = os.path.join(os.path.dirname(__file__), "snapshot_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))


def marked_lines(marker):
    with open(SCRIPT) as fh:
        return {n for n, line in enumerate(fh, start=1) if line.rstrip().endswith(f"# {marker}")}


def line_of(text):
    with open(SCRIPT) as fh:
        (n,) = [n for n, line in enumerate(fh, start=1) if line.strip() == text]
    return n


# -- the job --------------------------------------------------------------------------------------------------------




class Job:
    """A 2-rank torchrun job of snapshot_script.py in the background; :meth:`finish` leaves no worker behind."""

    def __init__(self, tmp_path, scenario):
        self.tmp_path = tmp_path
        self.root = str(tmp_path / "rdr")
        config = tmp_path / "obs.json"
        config.write_text(json.dumps({"rdr": {"enable": True, "path": self.root}}))
        self.pids = tmp_path / "pids"
        self.pids.mkdir()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MS_RDR", "OBS_")) or k.startswith("OBS_NATIVE")}
        env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        env.pop("TORCHELASTIC_RUN_ID", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "--monitor-interval", "0.2", SCRIPT, str(config), str(self.pids), scenario]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)

    def wait_for(self, *names, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not all((self.tmp_path / n).exists() for n in names):
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended first ({self.proc.returncode}):\n{self.proc.stdout.read()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the job never got there: {names}")
            time.sleep(0.05)

    def wait_in_collective(self, rank, timeout=60.0):
        """Until ``rank``'s ring shows it inside a collective (read from its ring file, as ``obs top`` would)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ring in glob.glob(os.path.join(self.root, f"rank_{rank}", "rdr", "ring_*.obsring")):
                try:
                    if open_collective(read_ring_file(ring)) is not None:
                        return
                except (OSError, ValueError):  # not fully there yet
                    pass
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} never entered a collective")

    def finish(self, timeout=90.0):
        return finish(self.proc, self.pids, "snapshot_script.py", timeout)


@pytest.fixture(name="job")
def _job(tmp_path):
    jobs = []

    def start(scenario):
        jobs.append(Job(tmp_path, scenario))
        return jobs[-1]

    yield start
    for j in jobs:  # a test that failed half-way: its job goes too
        if j.proc.poll() is None:
            os.killpg(j.proc.pid, signal.SIGKILL)
            j.proc.communicate()
        kill_leftovers(j.pids, "snapshot_script.py")


def cli(capsys, *args):
    code = main(["rdr", *args])
    return code, capsys.readouterr()


@pytest.mark.slow
def test_a_snapshot_of_a_running_job_names_the_rank_that_spins_in_user_code(job, tmp_path, capsys):
    j = job("spin")
    j.wait_for("rank0_waits", "rank1_spins")  # rank 1 spins in spin() while rank 0 enters step 2's all_reduce
    j.wait_in_collective(0)
    asked_ns = time.time_ns()
    code, out = cli(capsys, "snapshot", j.root, "--timeout", "60", "--json")
    returned_ns = time.time_ns()
    result = json.loads(out.out)
    assert code == 0 and result["complete"] and result["missing"] == [], result
    # In order: asked, both ranks answered, the wait ended on their answers (not its deadline), and all of it while
    # the job still spins (it cannot go on before the test releases it below).
    rows = {r["rank"]: r for r in result["ranks"]}
    assert sorted(rows) == [0, 1] and all(r["answered"] and r["pid"] > 0 for r in rows.values())
    assert all(asked_ns <= r["answered_ns"] <= returned_ns for r in rows.values()), rows
    assert result["waited_s"] < result["timeout_s"] and j.proc.poll() is None
    waiting = rows[0]["now"]["collective"]
    assert (waiting["op"], waiting["group"], waiting["state"]) == ("all_reduce", "default", "started")
    assert rows[1]["now"]["collective"] is None and rows[0]["step"] == rows[1]["step"] == 2
    bundles = {r: load_bundle(rows[r]["bundle"]) for r in rows}
    assert {b.info.reason for b in bundles.values()} == {"snapshot"}
    (main_thread,) = [s for s in bundles[1].stacks if s["main"]]
    assert "spin" in [f["function"] for f in main_thread["frames"][-2:]]  # every thread's stack, taken as it spun
    assert not os.path.exists(requests_dir(j.root))  # the request went, and its folder with it

    (tmp_path / "release").touch()  # the job goes on: rank 1 leaves its loop, both finish normally
    code, output = j.finish()
    assert code == 0 and "rank 0 done" in output and "rank 1 done" in output, output

    code, out = cli(capsys, "analyze", j.root, "--json")
    verdict = json.loads(out.out)
    assert code == 1 and verdict["culprits"] == [1], verdict
    where = verdict["ranks"][1]["where"]
    file, _, rest = where.rpartition(":")
    line, _, function = rest.partition(" in ")
    assert file == SCRIPT and function == "spin" and int(line) in marked_lines("the spin loop"), where
    assert verdict["verdict"].startswith("rank(s) 1 never reached default collective")
    assert verdict["verdict"].endswith(f"; rank 1 is at snapshot_script.py:{line} in spin")
    assert verdict["ranks"][0]["where"].endswith(f"snapshot_script.py:{line_of('dist.all_reduce(total)')} in main")
    code, out = cli(capsys, "analyze", j.root)
    assert code == 1 and f"rank 1 is at snapshot_script.py:{line} in spin" in out.out


@pytest.mark.slow
def test_a_hang_on_one_rank_makes_every_rank_dump(job, tmp_path, capsys):
    j = job("stall")  # rank 0's watchdog (2 s) fires in the all_reduce; rank 1 (no watchdog) sleeps in load_batch
    code, output = j.finish()
    assert code == 0 and "rank 1 done" in output, output  # rank 1's stall ends and the job finishes
    newest = {}
    for info in list_bundles(j.root).bundles:
        newest.setdefault(info.rank, info)
    assert {r: b.reason for r, b in newest.items()} == {0: "hang", 1: "peer_hang"}
    peer = load_bundle(newest[1].path)
    assert peer.manifest["fault"]["where"].startswith("asked by rank 0: no progress for ")
    (main_thread,) = [s for s in peer.stacks if s["main"]]
    assert main_thread["frames"][-1]["function"] == "load_batch"  # rank 1's stacks, while it stalled
    hang = load_bundle(newest[0].path)
    assert hang.manifest["now"]["collective"]["op"] == "all_reduce"
    assert not os.path.exists(requests_dir(j.root))  # rank 0 removed its request when it ended
    result = analyze(j.root)
    assert result.culprits == [1], result.verdict
    assert result.verdict.endswith(f"rank 1 is at snapshot_script.py:{line_of('time.sleep(5)')} in load_batch")


def test_snapshot_refuses_a_path_without_a_live_ring(tmp_path, capsys):
    code, out = cli(capsys, "snapshot", str(tmp_path))
    assert code == 2 and "no running job under" in out.err and str(tmp_path) in out.err and "Traceback" not in out.err
    assert cli(capsys, "snapshot", str(tmp_path / "missing"))[0] == 2
    assert cli(capsys, "snapshot", str(tmp_path), "--timeout", "0")[0] == 2


# -- now and where, on rings and bundles written here ---------------------------------------------------------------
def ring_with(tmp_path, collectives, modules=()):
    ring = RingWriter(str(tmp_path / "ring_1.obsring"), dict(DEFAULT_CAPACITY), pid=1, rank=0, world_size=2,
                      meta={"run_id": "job", "host": "h", "granularity": "module"})
    step, coll, mod = ring.appender("step"), ring.appender("collective"), ring.appender("module")
    step(Kind.STEP_BEGIN, 0, 0, 4, 0, 0)
    for scope, kind in modules:
        mod(kind, 0, ring.intern(scope), 4, 0, 0)
    for seq, group, op, state in collectives:
        desc = ring.intern(collective_desc({"op": op, "group": group, "dtype": "float32", "sizes": [[4]]}))
        coll(Kind.COLLECTIVE, 0, desc, seq, 0, COLLECTIVE_STATES.index(state))
    return ring


def test_now_is_the_step_the_innermost_open_module_and_the_open_collective(tmp_path):
    ring = ring_with(tmp_path, [(1, "default", "all_reduce", "started"), (1, "default", "all_reduce", "completed"),
                                (2, "default", "broadcast", "scheduled"), (2, "default", "broadcast", "started"),
                                (1, "1", "all_gather", "started"), (1, "1", "all_gather", "failed")],
                     modules=[("Default/net", Kind.MODULE_ENTER), ("Default/net/fc", Kind.MODULE_ENTER)])
    try:
        contents = read_ring(ring.buffer())
        got = now(contents)
        collective = got.pop("collective")
        assert got == {"step": 4, "module": "Default/net/fc", "phase": got["phase"], "last_seq": {"default": 2, "1": 1},
                       "module_since_ns": got["module_since_ns"]}
        assert got["phase"]["name"] in ("forward", "data")
        first = next(s for s in contents.slots if s["kind"] == Kind.COLLECTIVE and s["b"] == 2)
        assert collective == {"group": "default", "seq": 2, "op": "broadcast", "state": "started",
                              "since_ns": contents.header.wall(int(first["t"]))}  # since it was scheduled
    finally:
        ring.close(remove=True)


def test_now_has_no_collective_when_every_one_ended(tmp_path):
    ring = ring_with(tmp_path, [(1, "default", "all_reduce", "started"), (1, "default", "all_reduce", "completed")])
    try:
        got = now(read_ring(ring.buffer()))
        assert (got["step"], got["module"], got["collective"], got["last_seq"]) == (4, None, None, {"default": 1})
    finally:
        ring.close(remove=True)


def test_analyze_names_where_a_missing_ranks_snapshot_shows_it(tmp_path):
    def bundle(rank, seqs, reason, frames):
        rdr = tmp_path / f"rank_{rank}" / "rdr"
        os.makedirs(rdr, 0o700)
        ring = RingWriter(str(rdr / f"ring_{rank}.obsring"), dict(DEFAULT_CAPACITY), pid=100 + rank, rank=rank,
                          world_size=2, meta={"run_id": "job", "host": "h", "granularity": "step"})
        ring.appender("step")(Kind.STEP_BEGIN, 0, 0, 1, 0, 0)
        coll = ring.appender("collective")
        desc = ring.intern(collective_desc({"op": "all_reduce", "group": "default", "dtype": "float32", "sizes": []}))
        for seq in seqs:
            coll(Kind.COLLECTIVE, 0, desc, seq, 0, COLLECTIVE_STATES.index("started"))
        threads = [{"thread": "MainThread", "ident": 1, "daemon": False, "main": True, "frames": frames},
                   {"thread": "worker", "ident": 2, "daemon": True, "main": False,
                    "frames": [{"file": "/job/other.py", "line": 1, "function": "f", "code": ""}]}]
        manifest, files = bundle_parts(read_ring(ring.buffer()), reason, threads=threads)
        ring.close(remove=True)
        write_bundle(str(rdr), f"b_{rank}", manifest, files, fsync=False)

    torch_frame = {"file": os.path.join(os.path.dirname(os.__file__), "site-packages", "torch", "x.py"), "line": 9,
                   "function": "wait", "code": ""}
    bundle(0, [1, 2], "snapshot", [{"file": "/job/train.py", "line": 10, "function": "main", "code": ""},
                                   {"file": "/job/train.py", "line": 30, "function": "step", "code": ""}, torch_frame])
    bundle(1, [1], "snapshot", [{"file": "/job/train.py", "line": 10, "function": "main", "code": ""},
                                {"file": "/job/train.py", "line": 42, "function": "spin", "code": ""}])
    result = analyze(str(tmp_path))
    assert [s.where for s in result.ranks] == ["/job/train.py:30 in step", "/job/train.py:42 in spin"]
    assert result.culprits == [1]
    assert result.verdict == ("rank(s) 1 never reached default collective #2 (all_reduce), which rank(s) 0 entered; "
                              "rank 1 is at train.py:42 in spin")

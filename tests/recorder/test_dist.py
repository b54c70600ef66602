"""Real gloo jobs under torchrun (2 to 4 ranks): every collective on record, and `obs rdr analyze` names the
collective, its sequence number and the ranks on each side (dist_script.py holds the scenarios)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from exporters.trace_reader import iter_otlp_requests, request_spans
from obs.cli import main
from recorder.analyze import analyze
from recorder.bundle_reader import list_bundles, load_bundle
from recorder.hotpath import hotpath
from tests.recorder._jobs import finish, free_port

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "dist_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
PER_STEP = 6  # default-group collectives per step: 4 gradients, the loss, the stop flag
FIRST_OF_STEP_3 = 2 * PER_STEP + 1
C_PATH, PYTHON_PATH = "the C hot path", "the Python handlers"


def torchrun(tmp_path, ranks, scenario, *, mode=1, env=None, obs_run=False, **sections):
    """Run the job under torchrun (``ranks=None``: the script starts its own 2 ranks; ``obs_run``: under ``obs run``);
    returns (the exit code, the output); no worker outlives it."""
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "mode": mode}, **sections}))
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                                         "--master-port", str(free_port()), "--monitor-interval", "0.2"]
    if obs_run:
        launcher += ["-m", "obs", "run", "--config", str(config)]
    cmd = [sys.executable, *launcher, SCRIPT, str(config), str(pids), scenario]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    return finish(proc, pids, "dist_script.py", 150)


def collectives(tmp_path, rank):
    bundle = load_bundle(list_bundles(str(tmp_path / "rdr" / f"rank_{rank}")).bundles[0].path)
    with open(os.path.join(bundle.info.path, "collectives.jsonl")) as fh:
        return bundle, [json.loads(line) for line in fh if line.strip()]


def cli(capsys, *args):
    code = main(["rdr", "analyze", *args])
    return code, capsys.readouterr().out


def recorder_paths(out, **ranks):
    """Check that each rank of a job that mixes the recorder's paths (dist_script.py's PYTHON_RANKS) took the one
    asked for (``rank_0=C_PATH``...); the C hot path where it is built here, else the Python handlers."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("OBS_NATIVE", raising=False)
        env.delenv("OBS_NATIVE_RECORDER", raising=False)
        built = hotpath() is not None
    for name, path in ranks.items():
        path = path if built else PYTHON_PATH
        assert f"rank {name.removeprefix('rank_')} records through {path}" in out, out


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    """The ddp job (mode 2): rank 0 with PyTorch's Flight Recorder, rank 1 without (TORCH_FR_BUFFER_SIZE=0)."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    return tmp_path, *torchrun(tmp_path, 2, "ddp", mode=2)


@pytest.fixture(scope="module")
def ddp_hang_job(tmp_path_factory):
    """The ddp_hang job: rank 1 stalls 12 s in its data loading at step 3; rank 0's watchdog (2 s) dumps a hang as it
    waits in the bucket all_reduce, which gloo's timeout (6 s) then fails."""
    tmp_path = tmp_path_factory.mktemp("ddp_hang")
    return tmp_path, *torchrun(tmp_path, 2, "ddp_hang")


def test_a_clean_job_analyzes_consistent_with_subgroups_by_position_async_and_p2p(tmp_path, capsys):
    """Each path of the recorder (ranks 0 and 2 on the C hot path, 1 and 3 on the Python handlers) has a rank in the
    subgroup {0, 3} and one out of it, one in the send/recv pair {0, 1} and one out of it; analyze takes the two
    paths' bundles as one job."""
    code, out = torchrun(tmp_path, 4, "clean", mode=2)
    assert code == 0, out
    recorder_paths(out, rank_0=C_PATH, rank_1=PYTHON_PATH, rank_2=C_PATH, rank_3=PYTHON_PATH)
    run_ids = set()
    for rank in range(4):
        bundle, records = collectives(tmp_path, rank)
        assert bundle.info.reason == "normal_end"
        run_ids.add(bundle.info.run_id)
        done = [r for r in records if r["state"] == "completed"]
        default = [r for r in done if " group=default " in r["desc"]]
        assert [r["group_seq"] for r in default] == list(range(1, 4 * (PER_STEP + 1) + 1))  # + the async one
        sub = [r for r in done if "ranks=0,3" in r["desc"]]
        assert [r["group_seq"] for r in sub] == ([1, 2, 3, 4] if rank in (0, 3) else [])
        assert all(r["desc"].startswith("all_reduce group=") and "dtype=float32" in r["desc"] for r in sub)
        p2p = [r for r in done if ":p2p:0-1" in r["desc"]]
        # a send, a recv, then a batched isend and irecv a step (gloo's isend/irecv works polled to completion)
        assert [r["group_seq"] for r in p2p] == (list(range(1, 17)) if rank < 2 else [])
        assert [r["desc"].split(" ")[0] for r in p2p][:4] == (["send", "recv", "isend", "irecv"] if rank == 0 else
                                                             ["recv", "send", "irecv", "isend"] if rank == 1 else [])
        assert not [r for r in records if r["state"] not in ("started", "scheduled", "completed")]
        scheduled = [r["group_seq"] for r in records if r["state"] == "scheduled" and "group=default" in r["desc"]]
        assert scheduled and all(any(d["group_seq"] == s for d in default) for s in scheduled)
    assert len(run_ids) == 1 and run_ids != {"none"}  # torchrun gave "none": the ranks agreed on one
    assert cli(capsys, str(tmp_path / "rdr"))[0] == 0
    code, out = cli(capsys, str(tmp_path / "rdr"), "--json")
    result = json.loads(out)
    assert code == 0 and result["consistent"] and result["culprits"] == [] and result["world_size"] == 4
    assert result["run_id"] in run_ids and result["verdict"].startswith("consistent")


def test_ddp_bucket_all_reduces_are_on_record_as_issued_once_each_and_analyze_consistent(ddp_job):
    """Rank 0 of the ddp job: PyTorch's Flight Recorder on (rank 1's records without it: the next test)."""
    tmp_path, code, out = ddp_job
    assert code == 0, out
    _, records = collectives(tmp_path, 0)
    buckets = [r for r in records if r["desc"].startswith("all_reduce group=default dtype=float32 sizes=[[49]]")]
    # 4 steps, one bucket each (the net's 49 parameters), recorded by the relay as issued (the ring has them
    # while the job runs); the Flight Recorder's copy of each is left out of the bundle
    assert [(r["state"], r["step"], r.get("source")) for r in buckets] == \
        [(state, step, None) for step in range(1, 5) for state in ("scheduled", "completed")], records
    # DDP's start-up collectives (parameter shapes, module states), issued in C++, from the Flight Recorder
    start = [r for r in records if r["step"] == 0]
    assert [r["desc"].split(" ")[0] for r in start] == ["all_gather", "broadcast", "broadcast"]
    assert all(r.get("source") == "flight_recorder" for r in start)
    # one numbering for both sources (the group's own), each collective once: 3 at start, then 4 a step
    # (the bucket, the loss, the stop flag; the rebuild's 2 broadcasts at step 2)
    done = [r["group_seq"] for r in records if r["state"] == "completed"]
    assert done == list(range(1, 3 + 3 * 4 + 2 + 1)), records
    result = analyze(str(tmp_path / "rdr"))
    assert result.consistent and not result.mismatches, result.verdict


def test_ddp_buckets_go_through_the_relay_where_the_flight_recorder_is_off(ddp_job):
    """Rank 1 of the ddp job: TORCH_FR_BUFFER_SIZE=0; analyze lines it up with rank 0, which has the Flight Recorder's
    start-up collectives."""
    tmp_path, code, out = ddp_job
    assert code == 0, out
    assert "recorded through a Python communication hook" in out
    _, records = collectives(tmp_path, 1)
    assert not [r for r in records if "source" in r]
    buckets = [r for r in records if r["desc"].startswith("all_reduce group=default dtype=float32 sizes=[[49]]")]
    # scheduled by the relay, completed by the work's future
    assert [r["state"] for r in buckets] == ["scheduled", "completed"] * 4, records
    # numbered by the group: DDP's start-up collectives (not on record here) took 1-3
    assert buckets[0]["group_seq"] == 4
    result = analyze(str(tmp_path / "rdr"))
    assert result.consistent and not result.mismatches, result.verdict


def test_a_rank_waiting_in_ddps_bucket_all_reduce_dumps_it_in_flight_from_the_watchdog(ddp_hang_job):
    tmp_path, code, out = ddp_hang_job
    assert code != 0, out  # its all_reduce then timed out (the next test): the hang bundle came first
    bundles = list_bundles(str(tmp_path / "rdr" / "rank_0")).bundles
    (hang,) = [b for b in bundles if b.reason == "hang"]  # op_timeout (2 s), while blocked in the collective
    with open(os.path.join(hang.path, "collectives.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    last = records[-1]
    assert last["desc"].startswith("all_reduce group=default dtype=float32 sizes=[[49]]"), records
    # on record by the relay as it was issued
    assert (last["state"], last["step"], last.get("source"), last["group_seq"]) == ("scheduled", 3, None, 12)


def test_a_ddp_rank_that_stalls_past_gloos_timeout_is_named_and_the_waiting_rank_failed_in_the_bucket(ddp_hang_job):
    tmp_path, code, _ = ddp_hang_job
    assert code != 0
    result = analyze(str(tmp_path / "rdr"))
    assert result.culprits == [1], result.verdict
    (first,) = result.mismatches
    assert (first.seq, first.kind, first.step, first.sides["never reached it"]) == (12, "missing", 3, [1])
    rank0 = result.ranks[0]  # gloo retires a failed entry as a completed one: the bundle's exception says which
    assert rank0.raised_in_collective and (rank0.last_collective.seq, rank0.last_collective.state) == (12, "failed")


def test_a_killed_ddp_rank_is_named_at_the_bucket_it_never_reached_after_recover(tmp_path, capsys):
    """The killed rank on the recorder's Python handlers, the waiting one on its C hot path (the kill test has them
    the other way round): each path's ring of a killed rank, before and after recover."""
    code, out = torchrun(tmp_path, 2, "ddp_kill")
    assert code != 0
    recorder_paths(out, rank_0=C_PATH, rank_1=PYTHON_PATH)
    root = str(tmp_path / "rdr")
    before = analyze(root)
    assert before.no_bundle == [1] and before.culprits == [1]
    assert "obs rdr recover" in before.ranks[1].note
    code, out = cli(capsys, root)
    assert code == 1 and "recover it with: obs rdr recover" in out
    assert main(["rdr", "recover", root]) == 0
    capsys.readouterr()
    result = analyze(root)
    assert result.ranks[1].recovered and result.culprits == [1], result.verdict
    # rank 1 began step 3 and never reached its bucket all_reduce, which rank 0 entered (and failed in)
    (first,) = result.mismatches
    assert (first.seq, first.kind, first.step, first.sides["never reached it"]) == (12, "missing", 3, [1])
    assert first.sides == {"all_reduce float32 [[49]]": [0], "never reached it": [1]}


def test_a_ddp_rank_killed_before_any_peer_waited_on_it_is_named_after_recover(tmp_path, capsys):
    code, _ = torchrun(tmp_path, 2, "ddp_kill_first")  # torchrun stops rank 0 in its data loading at step 3
    assert code != 0
    root = str(tmp_path / "rdr")
    assert main(["rdr", "recover", root]) == 0
    capsys.readouterr()
    result = analyze(root)
    assert not result.mismatches and result.died == [1] and result.culprits == [1], result.verdict
    assert (result.ranks[0].reason, result.ranks[0].step, result.ranks[0].last_collective.seq) == ("SIGTERM", 3, 11)
    assert result.verdict.startswith("rank(s) 1 died without dumping (SIGKILL, OOM kill?) at step 3")
    code, text = cli(capsys, root)
    assert code == 1 and "culprit rank(s): 1" in text


def test_ranks_spawned_by_torch_multiprocessing_record_in_their_rank_folders_under_one_run_id(tmp_path):
    code, out = torchrun(tmp_path, None, "spawn", mode=2)
    assert code == 0, out
    assert sorted(n for n in os.listdir(tmp_path / "rdr") if n.startswith("rank_")) == ["rank_0", "rank_1"]
    run_ids = {collectives(tmp_path, rank)[0].info.run_id for rank in range(2)}
    assert len(run_ids) == 1
    for rank in range(2):
        _, records = collectives(tmp_path, rank)
        # DDP's bucket, recorded as it is issued and as it completes (obs's relay hook)
        assert [r["state"] for r in records if r["desc"].startswith("all_reduce") and "sizes=[[49]]" in r["desc"]] \
            == ["scheduled", "completed"] * 4
    result = analyze(str(tmp_path / "rdr"))
    assert result.consistent and result.run_id in run_ids and result.world_size == 2


def test_ranks_a_launcher_starts_without_rank_record_as_themselves_and_obs_run_follows_the_rerun_script(tmp_path):
    """Lightning's DDP launcher: rank 1 is the script again, started by subprocess with LOCAL_RANK and WORLD_SIZE but
    no RANK; obs only from ``obs run`` (rank 1 inherits it).  Each rank is its own everywhere once
    init_process_group has run, and analyze blames the rank that raised."""
    code, out = torchrun(tmp_path, None, "launcher", obs_run=True, profiler={"enable": True,
                                                                          "output": str(tmp_path / "profile")})
    assert code != 0 and "rank 1 lost its data loader" in out, out
    assert sorted(n for n in os.listdir(tmp_path / "rdr") if n.startswith("rank_")) == ["rank_0", "rank_1"], out
    hosts = set()
    for rank in range(2):
        bundle, _ = collectives(tmp_path, rank)
        marker = json.loads((tmp_path / "rdr" / f"rank_{rank}" / "rdr" / "marker.json").read_text())
        assert (bundle.manifest["rank"], bundle.manifest["world_size"]) == (rank, 2)
        assert (marker["rank"], marker["world_size"], marker["pid"]) == (rank, 2, bundle.manifest["pid"])
        hosts |= {bundle.manifest["host"], marker["host"]}
    spans = {}  # rank 1's profile stays in its rank_unresolved-{pid} folder; its spans say who it is
    for path in (tmp_path / "profile").glob("rank_*/traces.otlp.jsonl"):
        for _, request in iter_otlp_requests(str(path)):
            _, resource = request_spans(request)
            spans.setdefault(resource["ml.rank"], set()).add((resource["ml.world_size"], resource["host.name"]))
    assert {r: {w for w, _ in found} for r, found in spans.items()} == {0: {2}, 1: {2}}, spans
    assert {h for found in spans.values() for _, h in found} == hosts and len(hosts) == 1
    result = analyze(str(tmp_path / "rdr"))
    assert result.world_size == 2 and result.culprits == [1], result
    assert "lost its data loader" in {s.rank: s for s in result.ranks}[1].exception


def test_a_rank_that_skips_an_all_reduce_is_named(tmp_path, capsys):
    code, out = torchrun(tmp_path, 3, "skip")
    assert code != 0
    result = analyze(str(tmp_path / "rdr"))
    (first,) = [m for m in result.mismatches if m.group == "default"]
    assert (first.seq, first.kind, first.step) == (FIRST_OF_STEP_3 + 4, "op", 3), result
    assert first.sides == {"all_reduce float32 [[1]]": [0, 1], "broadcast float32 [[1]]": [2]}
    assert result.culprits == [2]
    code, out = cli(capsys, str(tmp_path / "rdr"))
    assert code == 1 and "culprit rank(s): 2" in out and f"collective #{FIRST_OF_STEP_3 + 4}" in out


def test_a_rank_with_a_mismatched_size_is_named(tmp_path, capsys):
    code, _ = torchrun(tmp_path, 3, "size")
    assert code != 0
    main(["rdr", "recover", str(tmp_path / "rdr")])  # a rank gloo aborted (SIGABRT) left its ring
    capsys.readouterr()
    result = analyze(str(tmp_path / "rdr"))
    assert not result.no_bundle, result
    (first,) = [m for m in result.mismatches if m.group == "default"]
    assert (first.seq, first.kind, first.culprits) == (FIRST_OF_STEP_3 + 4, "size", [1]), result
    assert first.sides == {"all_reduce float32 [[1]]": [0, 2], "all_reduce float32 [[2]]": [1]}
    assert result.culprits == [1]


def test_a_rank_that_raises_is_the_culprit_and_the_other_failed_in_the_collective(tmp_path):
    # 2 ranks: the first mismatch is a tie (one rank reached it, one never did), so the culprit can only come from
    # which rank raised in its own code, not from a majority
    code, _ = torchrun(tmp_path, 2, "raises")
    assert code != 0
    result = analyze(str(tmp_path / "rdr"))
    assert result.culprits == [1] and result.raised == [0, 1], result
    states = {s.rank: s for s in result.ranks}
    assert "lost its data loader" in states[1].exception and not states[1].raised_in_collective
    assert states[0].raised_in_collective
    (first,) = [m for m in result.mismatches if m.group == "default"]
    assert (first.seq, first.kind, first.sides["never reached it"]) == (FIRST_OF_STEP_3, "missing", [1])


def test_a_rank_killed_by_sigkill_is_named_before_and_after_recover(tmp_path, capsys):
    """The killed rank on the recorder's C hot path, the waiting one on its Python handlers (the ddp_kill test has
    them the other way round)."""
    code, out = torchrun(tmp_path, 2, "kill")
    assert code != 0
    recorder_paths(out, rank_0=PYTHON_PATH, rank_1=C_PATH)
    root = str(tmp_path / "rdr")
    before = analyze(root)
    assert before.no_bundle == [1] and before.culprits == [1]
    assert "obs rdr recover" in before.ranks[1].note
    code, out = cli(capsys, root)
    assert code == 1 and "recover it with: obs rdr recover" in out
    assert main(["rdr", "recover", root]) == 0
    capsys.readouterr()
    after = analyze(root)
    assert after.ranks[1].recovered and after.culprits == [1]
    (first,) = after.mismatches
    assert (first.seq, first.kind, first.sides["never reached it"]) == (FIRST_OF_STEP_3, "missing", [1])
    assert after.ranks[0].last_collective.seq == FIRST_OF_STEP_3


def test_the_first_nan_is_named_with_its_rank_and_step(tmp_path):
    code, out = torchrun(tmp_path, 2, "nan", mode=2, nan_check={"enable": True})
    assert code == 0, out
    result = analyze(str(tmp_path / "rdr"))
    assert (result.nan["rank"], result.nan["step"]) == (1, 3) and result.culprits == [1], result
    assert not result.mismatches and "first NaN/Inf at step 3" in result.verdict


def test_analyze_rejects_a_folder_without_rdr_files(tmp_path, capsys):
    assert main(["rdr", "analyze", str(tmp_path)]) == 2
    assert main(["rdr", "analyze", str(tmp_path / "missing")]) == 2

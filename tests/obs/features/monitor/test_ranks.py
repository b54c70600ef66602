"""The monitor across ranks: a 2-rank DDP job (gloo, CPU) whose rank 1 gets a bad batch at step 120, explained over
the job's root; which runs form a job, clocks of two hosts lined up, pipeline stages, one rank or all.

One module-scoped job (two processes, as torchrun and torch.multiprocessing.spawn start their workers: about 10-13 s
of CPU, most of it importing torch twice); the other cases are copies of its run folders, edited, in-process.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import types

import pytest

from obs._core.errors import DamagedFileError
from obs.cli import main
from obs.features.monitor.clock import TIMES, StepTimes, host_offsets, pipeline_stage, read_times
from obs.features.monitor.explain import _STAGE
from obs.features.monitor.job import explain_job, find_job, read_job
from obs.features.monitor.layout import CSV_PATTERN
from obs.features.monitor.reader import read_run
from tests.obs.features.monitor.ddp_script import BAD, STEPS

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's root of run folders, its two runs (rank 0, rank 1), each rank's losses and output."""
    out = tmp_path_factory.mktemp("ddp")
    config = out / "obs.json"
    config.write_text(json.dumps({"monitor": {
        "enable": True, "path": str(out / "monitor"), "xy_distribution": True, "step_count_per_record": 1000,
        "wg_distribution": True,  # with it, DDP's unreduced gradients (grad_unreduced) too
        "cc_distribution": {"enable": True, "cc_pre_hook": True},  # the script's all_reduce of its loss
        "targets": {"module.": {}, "module.0": {}, "module.2": {}}}}))  # every parameter; the first layers' xy
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "OBS_", "OTEL_", "MONITOR_")) or
           k.startswith("OBS_NATIVE")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = []
    for rank in (0, 1):
        extra = {"RANK": "0", "WORLD_SIZE": "2"} if rank == 0 else {}  # torchrun's way; spawn's says nothing
        procs.append(subprocess.Popen([sys.executable, SCRIPT, str(out), str(config), str(rank)], cwd=out,
                                      env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, text in zip(procs, outputs):
        assert proc.returncode == 0, text
    runs = {read_run(str(p)).rank: str(p) for p in (out / "monitor").iterdir()}
    losses = [json.loads((out / f"losses_{r}.json").read_text()) for r in (0, 1)]
    return {"root": str(out / "monitor"), "runs": runs, "losses": losses, "outputs": outputs}


def _copy(job, dest, edits, ranks=(0, 1)):
    """The job's runs of ``ranks`` copied under ``dest`` (named as new runs), each rank's monitor.json and step times
    edited: ``edits[rank]`` holds meta keys to set, ``tag`` (the start of the new run id) and ``shift_s``, added to
    the start and every step time."""
    dest.mkdir(exist_ok=True)
    made = {}
    for rank in ranks:
        folder = job["runs"][rank]
        edit = dict(edits.get(rank, {}))
        shift = int(edit.pop("shift_s", 0) * 1e9)
        tag = edit.pop("tag", "")
        base = os.path.basename(folder)
        name = base[:len(base) - 8] + tag + base[len(base) - 8 + len(tag):]  # the run id's first characters
        target = dest / name
        shutil.copytree(folder, target)
        meta = json.loads((target / "monitor.json").read_text())
        meta.update(edit)
        if shift:
            meta["started"] += shift / 1e9
            times = read_times(str(target))
            (target / TIMES).write_text("step,time_ns\n" + "".join(f"{s},{t + shift}\n" for s, t in times.items()))
        (target / "monitor.json").write_text(json.dumps(meta))
        made[rank] = str(target)
    return made


def test_the_models_run_as_before(job):
    """With the monitor on (activations too), every step's loss on each rank is the same, bit for bit, as without
    it, and obs reported no internal error."""
    for losses in job["losses"]:
        assert len(losses["watched"]) == STEPS and losses["watched"] == losses["plain"]
    assert not any("internal error" in text for text in job["outputs"])


def test_explain_over_the_root_says_rank_1s_activations_left_their_history_first(job):
    """The first anomaly is rank 1's first layer's input at step 120, in forward; it began on one rank; at that step
    the gradients after DDP's all-reduce moved on both ranks; nothing was flagged before it."""
    found = explain_job(find_job(job["root"]), read_job(find_job(job["root"])))
    first = found.first
    assert first is not None
    assert (first.step, first.rank, first.kind, first.stage, first.name) == (BAD, 1, "xy", "forward", "module.0.input")
    assert first.value > 100 * first.baseline
    assert found.scope == "one rank" and found.scope_ranks == [1]
    assert all(a.step >= BAD for a in found.anomalies)
    assert not [a for a in found.anomalies if a.kind == "xy" and a.rank == 0 and a.step == BAD]
    spread = {(s.stage, s.series, s.kind): s.ranks for s in found.spread}
    assert spread[("forward", "actv", "xy")] == [1]
    assert spread[("backward", "grad_unreduced", "wg")] == [1]  # each rank's own gradient, before the all-reduce
    assert spread[("backward", "grad_reduced", "wg")] == [0, 1]
    assert spread[("communication", "other", "cc")] == [0, 1]  # the loss's all_reduce, after backward
    at_bad = [a for a in found.anomalies if a.step == BAD]
    stages = [_STAGE[a.stage] for a in at_bad]
    assert stages == sorted(stages) and stages[-1] == _STAGE["communication"]
    cc = [(a.rank, a.name) for a in at_bad if a.kind == "cc"]  # by call in the step's order, before then after
    assert cc[:3] == [(1, "all_reduce/pre_0"), (0, "all_reduce/post_0"), (1, "all_reduce/post_0")]
    assert {name for _, name in cc[3:]} <= {"batch_isend_irecv/pre_0", "batch_isend_irecv/post_0"}
    assert found.loss_step == BAD and found.lead_steps == 0
    assert [r.rank for r in found.ranks] == [0, 1] and all(r.offset_s == 0 and r.timed for r in found.ranks)
    assert found.times[0] is not None and not found.left_out and not found.problems


def test_ddps_unreduced_gradients_are_each_ranks_own(job):
    """grad_unreduced holds each rank's gradient before the all-reduce: at the bad step rank 1's is twice the reduced
    one (the mean of two ranks, rank 0's being small), rank 0's is its own, far smaller; from step 1 on (the hooks
    go in at the first step); elsewhere the mean of the two ranks' is the reduced one."""
    runs = {r: read_run(f) for r, f in job["runs"].items()}

    def series(rank, prefix):
        return next(s for s in runs[rank].series if s.prefix == prefix and s.name == "module.4.bias")

    own = {r: dict(zip(series(r, "grad_unreduced").steps, series(r, "grad_unreduced").values)) for r in (0, 1)}
    reduced = dict(zip(series(0, "grad_reduced").steps, series(0, "grad_reduced").values))
    assert sorted(own[0]) == list(range(1, STEPS))
    assert own[1][BAD] == pytest.approx(2 * reduced[BAD], rel=0.01) and own[0][BAD] < reduced[BAD] / 10
    assert own[0][60] != own[1][60] and reduced[60] <= (own[0][60] + own[1][60]) / 2 * 1.0001


def test_explain_json_and_text_over_the_root(job, capsys):
    """`obs monitor explain ROOT --json`: first.rank, scope and its ranks, spread, ranks; the text says where it
    began and that the reduced gradients moved on both ranks; exit 1."""
    assert main(["monitor", "explain", job["root"], "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["first"]["rank"], doc["first"]["kind"], doc["first"]["step"]) == (1, "xy", BAD)
    assert doc["scope"] == "one rank" and doc["scope_ranks"] == [1]
    assert {"step": BAD, "stage": "backward", "kind": "wg", "series": "grad_reduced", "ranks": [0, 1],
            "count": 12} in doc["spread"]  # 6 parameters on each rank
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["anomalies"][0]["rank"] == 1
    assert all(isinstance(a["time"], float) for a in doc["anomalies"])
    main(["monitor", "explain", job["root"]])
    text = capsys.readouterr().out
    assert re.search(r"first anomaly: step 120 \(rank 1, forward\): xy module\.0\.input actv/norm", text)
    assert "it began on one rank, rank 1 of 2" in text
    assert "backward wg grad_unreduced on rank 1; backward wg grad_reduced on ranks 0, 1" in text


def test_show_over_the_root_names_each_series_rank(job, capsys):
    assert main(["monitor", "show", job["root"], "--json", "--top", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {m["rank"] for m in doc["series"]} == {0, 1} and all(m["peak_step"] == BAD for m in doc["series"])
    assert BAD in doc["steps"]


def test_a_rank_that_started_before_init_process_group_learns_its_rank(job):
    """Rank 1 started as torch.multiprocessing.spawn starts it: its run folder is named as rank 0's (the monitor
    started before init_process_group), its monitor.json says rank 1 from the first step on."""
    folder = job["runs"][1]
    assert "-rank0-" in os.path.basename(folder)
    assert json.loads(pathlib.Path(folder, "monitor.json").read_text())["world_size"] == 2


def test_a_python_collective_is_measured_on_each_rank_before_and_after(job):
    """The script's all_reduce of its loss (cc_pre_hook): before it, each rank's own loss; after it, the sum of the
    two, the same on both ranks, at every step; rank 1's own jumps at the bad step."""
    runs = {r: read_run(f) for r, f in job["runs"].items()}

    def values(rank, name):
        found = [s for s in runs[rank].series if s.prefix == "other" and s.name == name and s.stat == "norm"]
        assert len(found) == 1 and found[0].micro == 0 and (found[0].kind, found[0].stage) == ("cc", "communication")
        return dict(zip(found[0].steps, found[0].values))

    own = {r: values(r, "all_reduce/pre_0") for r in (0, 1)}
    after = {r: values(r, "all_reduce/post_0") for r in (0, 1)}
    assert sorted(after[0]) == list(range(STEPS)) and after[0] == after[1]
    assert all(after[0][s] == pytest.approx(own[0][s] + own[1][s], rel=1e-5) for s in range(STEPS))
    assert own[1][BAD] > 1000 * own[0][BAD]
    for r in (0, 1):  # the norm of the loss is the loss
        assert own[r][5] == pytest.approx(job["losses"][r]["watched"][5], rel=1e-5)
    # the losses exchanged by batch_isend_irecv (a P2POp pair made with isend/irecv imported before obs wrapped
    # them, used again after the monitor ended: the plain run): after it, each rank holds both losses
    for r in (0, 1):
        assert runs[r].meta["collectives"] == ["all_reduce", "batch_isend_irecv"]  # the order of their first call
        pair = values(r, "batch_isend_irecv/post_0")
        assert all(pair[s] == pytest.approx(math.hypot(own[0][s], own[1][s]), rel=1e-5) for s in range(STEPS))


def test_msprobes_files_stay_as_they_were(job):
    """msprobe's CSV columns are unchanged; the step times are a file of their own, which neither msprobe's csv2tb
    (``{data_type}_\\d+-\\d+\\.csv``) nor obs's reader takes for a monitor CSV file."""
    folder = job["runs"][0]
    heads = {p.name: p.read_text().splitlines()[0] for p in pathlib.Path(folder).glob("*.csv")}
    assert heads["actv_0-999.csv"] == "vpp_stage,name,step,micro_step,norm,shape,dtype"
    assert heads["grad_reduced_0-999.csv"] == "vpp_stage,name,step,norm,shape,dtype"
    assert heads["grad_unreduced_0-999.csv"] == heads["grad_reduced_0-999.csv"]
    assert heads[TIMES] == "step,time_ns"
    assert not re.match(r"\w+_\d+-\d+\.csv", TIMES) and not CSV_PATTERN.fullmatch(TIMES)
    times = read_times(folder)
    assert sorted(times) == list(range(STEPS)) and all(b > a for a, b in zip(times.values(), list(times.values())[1:]))


def test_clocks_of_two_hosts_are_lined_up(job, tmp_path):
    """Rank 1 on another host whose clock is 5 s ahead: its offset is found from the steps' ends, and its anomalies'
    times are on rank 0's clock."""
    _copy(job, tmp_path, {1: {"host": "other-host", "shift_s": 5.0}})
    found = explain_job(find_job(str(tmp_path)), read_job(find_job(str(tmp_path))))
    assert found.ranks[1].host == "other-host" and found.ranks[1].offset_s == pytest.approx(5.0, abs=0.5)
    at = {(a.rank, a.name): t for a, t in zip(found.anomalies, found.times) if a.name == "grad_norm"}
    assert at[(1, "grad_norm")] == pytest.approx(at[(0, "grad_norm")], abs=0.5)
    assert host_offsets({0: "a", 1: "b", 2: "a"}, {0: {1: 100, 2: 200}, 1: {1: 150, 2: 260}}) == {"a": 0, "b": 55}


def test_which_runs_form_the_job(job, tmp_path):
    """Of the runs under a root: an earlier job's runs (an hour before) and a rank's earlier run of this job (before
    a hot reload) are left out; the newest run of each rank of the job that ran last is read."""
    now = _copy(job, tmp_path, {0: {"tag": "a"}, 1: {"tag": "a"}})
    _copy(job, tmp_path, {0: {"tag": "b", "shift_s": -3600}, 1: {"tag": "b", "shift_s": -3600}})  # an earlier job
    # rank 0's run before a hot reload (a folder one level down)
    _copy(job, tmp_path / "x", {0: {"tag": "c", "shift_s": -5}}, ranks=(0,))
    found = find_job(str(tmp_path))
    assert found.folders == [now[0], now[1]] and len(found.left_out) == 3
    # with the launcher's job id, the runs of the newest run's id, whatever their times
    again = tmp_path / "ids"
    ids = _copy(job, again, {0: {"tag": "d", "job": "j1", "shift_s": -3600}, 1: {"tag": "d", "job": "j1"}})
    _copy(job, again, {0: {"tag": "e", "job": "j0", "shift_s": -7200}, 1: {"tag": "e", "job": "j0", "shift_s": -10}})
    assert find_job(str(again)).folders == [ids[0], ids[1]]


def test_pipeline_stages_and_all_ranks(job, tmp_path):
    """With pipeline stages in monitor.json, backward is ordered from the last stage (rank 1 here) to the first.
    Without the activations and the loss, the unreduced gradients still say it began on rank 1 (as for a faulty
    device); without them too, it begins in the reduced gradients, on all ranks."""
    made = _copy(job, tmp_path, {0: {"pp_stage": 0}, 1: {"pp_stage": 1}})
    found = explain_job(find_job(str(tmp_path)), read_job(find_job(str(tmp_path))))
    reduced = [a for a in found.anomalies if a.series == "grad_reduced"]
    assert found.first is not None and found.first.rank == 1 and reduced[0].rank == 1
    plain = explain_job(find_job(job["root"]), read_job(find_job(job["root"])))
    assert next(a for a in plain.anomalies if a.series == "grad_reduced").rank == 0
    for prefixes, series, scope, ranks in ((("actv_", "scalars_"), "grad_unreduced", "one rank", [1]),
                                           (("grad_unreduced_",), "grad_reduced", "all ranks", [0, 1])):
        for folder in made.values():
            for name in os.listdir(folder):
                if name.startswith(prefixes):
                    os.remove(os.path.join(folder, name))
        found = explain_job(find_job(str(tmp_path)), read_job(find_job(str(tmp_path))))
        assert found.first is not None and (found.first.series, found.first.step) == (series, BAD)
        assert found.scope == scope and found.scope_ranks == ranks


def test_runs_without_step_times_are_merged_by_step(job, tmp_path):
    """Runs with no step_times.csv (msprobe's own, or an older obs): merged by step number, their anomalies without
    a time, and a damaged step times file is an error naming it and the line."""
    made = _copy(job, tmp_path, {})
    os.remove(os.path.join(made[1], TIMES))
    found = explain_job(find_job(str(tmp_path)), read_job(find_job(str(tmp_path))))
    assert found.first is not None and (found.first.rank, found.first.step) == (1, BAD) and found.times[0] is None
    assert [r.timed for r in found.ranks] == [True, False]
    pathlib.Path(made[0], TIMES).write_text("step,time_ns\n0,12\nx,3\n")
    with pytest.raises(DamagedFileError, match=r"step_times\.csv:3: expected 'step,time_ns'"):
        find_job(str(tmp_path))


def test_the_pipeline_stage_comes_from_megatrons_parallel_state(tmp_path, monkeypatch):
    """At the first step the step times' writer adds Megatron's pipeline rank to monitor.json (and to what the
    collector sends later); one line per step, the last ones written at close."""
    mpu = types.ModuleType("megatron.core.parallel_state")
    mpu.model_parallel_is_initialized = lambda: False  # type: ignore[attr-defined]
    mpu.get_pipeline_model_parallel_rank = lambda: 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", mpu)
    assert pipeline_stage() is None
    mpu.model_parallel_is_initialized = lambda: True  # type: ignore[attr-defined]
    (tmp_path / "monitor.json").write_text(json.dumps({"format": "obs-monitor", "rank": 0}))
    meta = {"rank": 0}
    times = StepTimes(str(tmp_path), meta)
    for step, t in ((0, 5), (0, 6), (1, 7)):
        times(step, t)
    times.close()
    assert meta["pp_stage"] == 3 and json.loads((tmp_path / "monitor.json").read_text())["pp_stage"] == 3
    assert read_times(str(tmp_path)) == {0: 5, 1: 7}

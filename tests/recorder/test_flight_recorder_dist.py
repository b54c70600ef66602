"""PyTorch's Flight Recorder entries merged into a bundle's collectives (pure), and in a one-rank gloo job's bundle."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import obs
from recorder.flight_recorder import collective_error, entry_record, merge_entries


def _entry(seq, *, t, op="gloo:all_reduce", pg=("0", "default_pg"), retired=True, p2p=False):
    """A Flight Recorder entry as ``_dump_fr_trace`` gives it for gloo (no timings, retired once the work ended)."""
    return {"collective_seq_id": seq, "process_group": pg, "profiling_name": op, "input_sizes": [[49]],
            "input_dtypes": ["Float"], "time_created_ns": t, "retired": retired, "state": "scheduled",
            "time_discovered_completed_ns": None, "is_p2p": p2p}


def _record(entry, status=None):
    return entry_record(entry, default_name="0", members={"3": "0,2"}, status=status or {})


def test_an_entry_reads_as_obs_record():
    assert _record(_entry(4, t=100)) == {"op": "all_reduce", "group": "default", "seq": 4, "sizes": [[49]],
                                         "dtype": "float32", "state": "completed", "t": 100, "duration_ns": 0}
    sub = _record(_entry(2, t=5, op="nccl:broadcast", pg=("3", "undefined"), retired=False))
    assert (sub["group"], sub["ranks"], sub["op"], sub["state"]) == ("3", "0,2", "broadcast", "scheduled")
    started = _record(_entry(2, t=5, pg=("3", ""), retired=False), {"3": {"last_started_collective": 2}})
    assert started["state"] == "started"
    assert _record(_entry(1, t=5, p2p=True)) is None  # obs numbers point-to-point ops per pair itself
    assert _record(_entry(0, t=5)) is None


def _line(seq, t, kind="step_begin", step=1, **more):
    return json.dumps({"seq": seq, "t": t, "kind": kind, "step": step, **more})


def test_merge_adds_what_obs_did_not_record_in_time_order_once():
    ours = _line(3, 30, "collective", desc="all_reduce group=default dtype=float32 sizes=[[1]]", group_seq=5,
                 state="completed", duration_ns=7)
    files = {"events.jsonl": [_line(1, 10), _line(2, 20, "module_enter"), ours, _line(4, 40, "step_end")],
             "collectives.jsonl": [ours]}
    records = [_record(_entry(n, t=t)) for n, t in ((3, 5), (4, 25), (5, 29), (6, 35))]
    assert merge_entries(files, records) == 2  # #3 is older than the bundle, #5 is obs's own record
    kinds = [(json.loads(x)["kind"], json.loads(x).get("group_seq")) for x in files["events.jsonl"]]
    assert kinds == [("step_begin", None), ("module_enter", None), ("collective", 4), ("collective", 5),
                     ("collective", 6), ("step_end", None)]
    added = json.loads(files["events.jsonl"][2])
    assert (added["seq"], added["step"], added["source"], added["state"]) == (2, 1, "flight_recorder", "completed")
    assert [json.loads(x)["group_seq"] for x in files["collectives.jsonl"]] == [4, 5, 6]
    assert merge_entries(files, records) == 0  # already there


def test_the_newest_entry_is_failed_where_the_bundle_holds_a_communication_error():
    timeout = json.dumps({"type": "RuntimeError", "message": "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                                             "waiting 6000ms for recv operation to complete"})
    assert collective_error(timeout) and collective_error(json.dumps({"type": "torch.distributed.DistBackendError"}))
    assert not collective_error(json.dumps({"type": "ValueError", "message": "bad batch"}))
    assert not collective_error("{damaged") and not collective_error(None)

    def files(exception):
        return {"events.jsonl": [_line(1, 10)], "collectives.jsonl": [], "exception.json": exception}

    failed = files(timeout)
    assert merge_entries(failed, [_record(_entry(4, t=20)), _record(_entry(5, t=30))]) == 2
    states = [(json.loads(x)["state"], json.loads(x).get("error")) for x in failed["collectives.jsonl"]]
    assert states == [("completed", None), ("failed", True)]
    other = files(json.dumps({"type": "ValueError", "message": "bad batch"}))
    merge_entries(other, [_record(_entry(4, t=20))])
    assert json.loads(other["collectives.jsonl"][0])["state"] == "completed"


def test_a_one_rank_ddp_bundle_holds_its_buckets_from_the_flight_recorder(tmp_path):
    from obs import rdr

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = tmp_path / "obs.json"
        config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
        obs.set_context(env_config_path=str(config))
        # buckets as views: the reducer averages them in place, which obs's relay hook cannot match to the bit, so
        # they take the Flight Recorder's road (other DDP models' buckets are recorded live by the relay)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), gradient_as_bucket_view=True)
        for _ in range(2):
            with obs.step():
                ddp(torch.randn(3, 4)).sum().backward()
                dist.all_reduce(torch.ones(1))
        path = rdr.dump("manual")
    finally:
        obs.reset_context()
        dist.destroy_process_group()
    with open(os.path.join(path, "collectives.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    done = [(r["group_seq"], r["desc"].split(" group=")[0], r["step"], r.get("source")) for r in records
            if r["state"] == "completed"]
    fr = "flight_recorder"
    # a group made before obs started is recorded too (torch 2.13's Flight Recorder is on by default): DDP's
    # start-up collectives, its buckets, the bucket rebuild at step 2, obs's own records of the Python all_reduces
    assert done == [(1, "all_gather", 0, fr), (2, "broadcast", 0, fr), (3, "broadcast", 0, fr),
                    (4, "all_reduce", 1, fr), (5, "all_reduce", 1, None), (6, "broadcast", 2, fr),
                    (7, "broadcast", 2, fr), (8, "all_reduce", 2, fr), (9, "all_reduce", 2, None)], done
    with open(os.path.join(path, "events.jsonl")) as fh:
        events = [json.loads(line) for line in fh]
    assert [e.get("group_seq") for e in events if e["kind"] == "collective" and e["state"] == "completed"] == \
        list(range(1, 10))
    steps = [e["t"] for e in events if e["kind"] == "step_begin"]
    bucket = next(e for e in events if e.get("group_seq") == 8)
    assert steps[1] <= bucket["t"]  # placed in time, after step 2 began

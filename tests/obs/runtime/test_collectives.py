"""torch.distributed collectives publish COLLECTIVE records (gloo, one process) and the wrappers come off."""

from __future__ import annotations

import torch
import torch.distributed as dist

import obs
from obs.runtime.torch import _p2p, adapter


def test_collectives_are_recorded_with_sequence_state_and_timing(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    original = dist.all_reduce
    try:
        records = []
        with obs.subscribe(obs.Event.COLLECTIVE, records.append):
            assert adapter.installed["collectives"] and dist.all_reduce is not original
            t = torch.ones(4, 3)
            dist.all_reduce(t)
            dist.barrier()
            work = dist.all_reduce(torch.ones(2), async_op=True)
            work.wait()
            dist.broadcast(t, src=0)  # the next call notices the async one completed
        assert dist.all_reduce is original and not adapter.installed["collectives"]
    finally:
        _drain_and_destroy()
    seen = [(r["op"], r["seq"], r["state"]) for r in records]
    assert seen[:4] == [("all_reduce", 1, "started"), ("all_reduce", 1, "completed"), ("barrier", 2, "started"),
                        ("barrier", 2, "completed")]
    assert ("all_reduce", 3, "scheduled") in seen and ("all_reduce", 3, "completed") in seen
    assert seen.index(("all_reduce", 3, "completed")) > seen.index(("all_reduce", 3, "scheduled"))
    first = records[1]
    assert first["sizes"] == [[4, 3]] and first["dtype"] == "float32" and first["duration_ns"] > 0
    assert first["group"] == "default"


def _records_of(run, tmp_path, records=None):
    """``run()`` in a one-rank gloo group while COLLECTIVE is subscribed; the records it published."""
    records = [] if records is None else records
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with obs.subscribe(obs.Event.COLLECTIVE, records.append):
            run()
    finally:
        _drain_and_destroy()
    return records


def _drain_and_destroy():
    """Destroy the default group once gloo's worker thread is idle.  That thread releases a finished work's Python
    callbacks (DDP's hooks, obs's completion callback) under the GIL, after the waiter has moved on; a group
    destroyed meanwhile (a DDP model dropped at the test's end) joins it while holding the GIL: a deadlock
    in PyTorch, seen once in CI.  A barrier runs on that thread after the work before it is fully done."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_group_passed_by_position_is_that_group_with_its_own_sequence(tmp_path):
    def run():
        sub = dist.new_group([0])
        t = torch.ones(3)
        dist.all_reduce(t, dist.ReduceOp.SUM, sub)  # group by position
        dist.broadcast(t, 0, group=sub)
        dist.all_reduce(t, dist.ReduceOp.SUM, dist.group.WORLD)  # the world group by position is "default"
        dist.all_reduce(t, group=dist.distributed_c10d._get_default_group())

    done = [(r["op"], r["group"], r.get("ranks"), r["seq"]) for r in _records_of(run, tmp_path)
            if r["state"] == "completed"]
    sub = done[0][1]
    assert sub != "default" and done == [("all_reduce", sub, "0", 1), ("broadcast", sub, "0", 2),
                                         ("all_reduce", "default", None, 1), ("all_reduce", "default", None, 2)]


def test_async_work_is_completed_by_its_future_not_by_the_next_call(tmp_path):
    records, after_wait = [], []

    def run():
        dist.all_reduce(torch.ones(2), async_op=True).wait()
        after_wait.extend(r["state"] for r in records)

    _records_of(run, tmp_path, records)
    assert after_wait == ["scheduled", "completed"]  # no later call needed
    assert records[1]["duration_ns"] > 0 and records[1]["seq"] == records[0]["seq"] == 1


def test_a_collective_that_raises_is_recorded_failed(tmp_path):
    raised = []

    def run():
        try:
            dist.all_reduce(torch.ones(2), "not an op")
        except Exception as exc:  # noqa: BLE001 - the test looks at whatever it raised
            raised.append(exc)

    records = _records_of(run, tmp_path)
    assert raised and [r["state"] for r in records] == ["started", "failed"]
    assert type(raised[0]).__name__ in records[1]["error"]


def test_ddp_gradient_buckets_are_all_reduced_on_record_and_a_user_hook_takes_over(tmp_path):
    """The relay: every DDP model built while obs records gets it (a bucket on record as it is issued)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    calls = []

    def user_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    def run():
        torch.manual_seed(0)
        plain = torch.nn.Linear(4, 2)
        ddp = DDP(torch.nn.Linear(4, 2))
        models.append(ddp)
        ddp.module.load_state_dict(plain.state_dict())
        x = torch.randn(3, 4)
        ddp(x).sum().backward()
        plain(x).sum().backward()
        for a, b in zip(ddp.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)  # the relay reduces as DDP does without a hook
        marks.append(len(records))
        ddp.register_comm_hook(None, user_hook)
        ddp(x).sum().backward()
        try:
            ddp.register_comm_hook(None, user_hook)
        except RuntimeError as exc:
            second.append(str(exc))

    marks, second, records, models = [], [], [], []
    _records_of(run, tmp_path, records)
    assert DDP.__init__.__module__ == "torch.nn.parallel.distributed"  # the class is put back
    assert models[0]._obs_relay.record is None  # the model built meanwhile goes on reducing, off record
    buckets = [r for r in records[:marks[0]] if r["op"] == "all_reduce"]
    assert [r["state"] for r in buckets] == ["scheduled", "completed"] and buckets[1]["sizes"] == [[10]]
    assert calls == [0] and [r["state"] for r in records[marks[0]:] if r["op"] == "all_reduce"] == \
        ["scheduled", "completed"]
    assert second and "only be called once" in second[0]


def test_device_work_is_completed_by_polling_not_by_its_future(tmp_path, monkeypatch):
    """NCCL completes a work's future at enqueue: device collectives are polled (forced here on gloo)."""
    from obs.runtime.steps import tracker
    from obs.runtime.torch import _collectives

    monkeypatch.setattr(_collectives, "_device_work", lambda tensors: True)
    seen = []

    def run():
        t = torch.ones(3)
        assert dist.all_reduce(t, dist.ReduceOp.SUM) is None  # blocking for the caller, async underneath
        seen.append([r["state"] for r in records])
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        seen.append([r["state"] for r in records])
        assert adapter._collectives.poll in tracker.at_boundary
        tracker.at_boundary.call()  # a step boundary polls
        seen.append([r["state"] for r in records])

    records = []
    _records_of(run, tmp_path, records)
    assert seen == [["started"], ["started", "completed", "scheduled"],
                    ["started", "completed", "scheduled", "completed"]]
    assert [r["seq"] for r in records] == [1, 1, 2, 2]
    assert not any(getattr(h, "__self__", None).__class__.__name__ == "CollectiveHooks" for h in tracker.at_boundary)


def test_a_model_whose_gradients_are_bucket_views_keeps_its_cpp_reduction_and_the_flight_recorder_has_it(tmp_path):
    """The relay cannot repeat the reducer's in-place division of a gradient that is its bucket's view."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run():
        ddp = DDP(torch.nn.Linear(4, 2), gradient_as_bucket_view=True)
        models.append(ddp)
        ddp(torch.randn(3, 4)).sum().backward()
        ddp.register_comm_hook(None, allreduce_hook)  # the user's hook goes to DDP itself
        ddp(torch.randn(3, 4)).sum().backward()

    records, models = [], []
    _records_of(run, tmp_path, records)
    assert "_obs_relay" not in models[0].__dict__ and models[0]._comm_hooks == [(allreduce_hook, None)]
    # the bucket DDP reduced in C++ is not published (the Flight Recorder has it); the user's hook's all_reduce is,
    # numbered by the group: after DDP's 3 start-up collectives, the first bucket, the rebuild's 2 broadcasts
    assert [(r["op"], r["seq"], r["state"]) for r in records] == [("all_reduce", 7, "scheduled"),
                                                                  ("all_reduce", 7, "completed")]


def test_removed_under_another_tools_wrapper_its_wrapper_stays_and_ours_passes_through(tmp_path):
    """Another tool wraps the collective after obs (the monitor's cc, a user's): obs's recorder coming off leaves
    that wrapper in place, and obs's own, still under it, records nothing more."""
    from torch.distributed import distributed_c10d as c10d

    original = dist.all_reduce
    records, calls = [], []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with obs.subscribe(obs.Event.COLLECTIVE, records.append):
            ours = dist.all_reduce
            assert ours is not original

            def theirs(*args, **kwargs):
                calls.append(1)
                return ours(*args, **kwargs)

            dist.all_reduce = c10d.all_reduce = theirs
            dist.all_reduce(torch.ones(2))
        assert dist.all_reduce is theirs and c10d.all_reduce is theirs and not adapter.installed["collectives"]
        seen = len(records)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert len(calls) == 2 and len(records) == seen == 2 and t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.all_reduce = c10d.all_reduce = original
        _drain_and_destroy()


def test_a_p2p_op_made_with_isend_imported_before_obs_passes_torchs_checks(tmp_path):
    """A module that imported isend/irecv before obs wrapped them (``from torch.distributed import isend``): its
    P2POp passes torch's check (by equality) and batch_isend_irecv gets obs's wrapper for it (torch tells an isend
    from an irecv by identity); one made while obs's wrappers were in place works after they come off.  (A real
    exchange needs two ranks: the monitor's 2-rank job does one; here torch's checks and the hand-over.)"""
    from torch.distributed import distributed_c10d as c10d

    torch_isend, torch_irecv = c10d.isend, c10d.irecv
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with obs.subscribe(obs.Event.COLLECTIVE, lambda record: None):
            assert c10d.isend is not torch_isend and c10d.isend == torch_isend and c10d.irecv == torch_irecv
            early = dist.P2POp(torch_isend, torch.ones(1), 0)  # torch's _check_op: ValueError before the fix
            made_while = dist.P2POp(dist.irecv, torch.zeros(1), 0)
            _p2p.same_ops(([early, made_while],), {})
            assert early.op is c10d.isend and made_while.op is c10d.irecv
            assert hasattr(dist.batch_isend_irecv, "__wrapped__")  # wrapped: it hands the ops over
            got = {}
            made_while.op._call = lambda *a, **k: got.update(k)  # what the peer reaches the wrapper as
            made_while.op(torch.zeros(1), group_dst=0)  # batch_isend_irecv's keyword for a function not its irecv
            assert got == {"group_src": 0}
        assert c10d.isend is torch_isend and dist.isend is torch_isend and dist.batch_isend_irecv is \
            c10d.batch_isend_irecv and not hasattr(dist.batch_isend_irecv, "__wrapped__")
    finally:
        _drain_and_destroy()


def _compiled_counters():
    """Dynamo's counters of a compiled function that all_reduces, run twice (backend eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def double_and_reduce(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    compiled = torch.compile(double_and_reduce, backend="eager")
    for _ in range(2):
        out = compiled(torch.ones(3))
    got = {"stats": dict(counters["stats"]), "graph_break": dict(counters["graph_break"]), "out": out.tolist()}
    torch._dynamo.reset()
    return got


def test_a_compiled_collective_compiles_and_runs_as_without_obs(tmp_path):
    """Dynamo remaps a traced ``dist.all_reduce`` to torch's functional collective by the function's identity: obs's
    wrapper hands a traced call to torch's own (it crashed Dynamo, UnsafeScriptObjectError, when the functional
    collectives were imported before obs wrapped), and obs imports them before it wraps, so that their table keeps
    torch's functions (imported under obs's wrapper, e.g. by DDP, a compiled collective broke the graph once obs was
    off)."""
    import torch.distributed._functional_collectives  # noqa: F401 - as a process that compiled one before obs

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain = _compiled_counters()
        with obs.subscribe(obs.Event.COLLECTIVE, lambda record: None):
            assert dist.all_reduce.__wrapped__ is not None
            assert _compiled_counters() == plain
        assert _compiled_counters() == plain
    finally:
        _drain_and_destroy()
    assert plain["stats"]["unique_graphs"] == 1 and not plain["graph_break"] and plain["out"] == [3.0] * 3

"""torch.distributed collectives publish COLLECTIVE records (gloo, one process) and the wrappers come off."""

from __future__ import annotations

import torch
import torch.distributed as dist

import obs
from obs.runtime.torch import adapter


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
        dist.destroy_process_group()
    seen = [(r["op"], r["seq"], r["state"]) for r in records]
    assert seen[:4] == [("all_reduce", 1, "started"), ("all_reduce", 1, "completed"), ("barrier", 2, "started"),
                        ("barrier", 2, "completed")]
    assert ("all_reduce", 3, "scheduled") in seen and ("all_reduce", 3, "completed") in seen
    assert seen.index(("all_reduce", 3, "completed")) > seen.index(("all_reduce", 3, "scheduled"))
    first = records[1]
    assert first["sizes"] == [[4, 3]] and first["dtype"] == "float32" and first["duration_ns"] > 0
    assert first["group"] == "default"

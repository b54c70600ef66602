"""Collectives on one GPU: NCCL with world size 1 (its Flight Recorder merged as gloo's is) and gloo with CUDA tensors.

Mirrors tests/recorder/test_flight_recorder_dist.py's one-rank DDP job: DDP's bucket all_reduces, issued from C++,
reach the bundle from PyTorch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``; NCCL's may record into its own CUDA-event
recorder, in which case obs records them through DDP's Python relay), the Python all_reduces from obs's wrappers;
``obs rdr analyze`` reads them back from collectives.bin.  Two NCCL ranks need two GPUs: untested here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import obs
from recorder import collective_table
from recorder.analyze import analyze

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_one_rank_ddp_job_on_cuda_has_every_collective_in_its_bundle(tmp_path, monkeypatch, backend):
    from obs import rdr

    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # before the group exists: NCCL's recorder reads it then
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    torch.cuda.set_device(CUDA)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = tmp_path / "obs.json"
        config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
        obs.set_context(env_config_path=str(config))
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).to(CUDA), device_ids=[0])
        for _ in range(3):
            with obs.step():
                ddp(torch.randn(3, 4, device=CUDA)).sum().backward()
                dist.all_reduce(torch.ones(1, device=CUDA))
        torch.cuda.synchronize()
        path = rdr.dump("manual")
    finally:
        obs.reset_context()
        dist.destroy_process_group()
    with open(os.path.join(path, "collectives.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    done = [r for r in records if r["state"] == "completed"]
    buckets = [r for r in done if r["desc"].startswith("all_reduce group=default dtype=float32 sizes=[[") and
               r["desc"] != "all_reduce group=default dtype=float32 sizes=[[1]]"]
    ours = [r for r in done if r["desc"] == "all_reduce group=default dtype=float32 sizes=[[1]]"]
    assert len(ours) == 3 and all("source" not in r for r in ours), records
    assert len(buckets) >= 3, records  # one bucket a step, from the Flight Recorder or DDP's relay
    seqs = [r["group_seq"] for r in done]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    with open(os.path.join(path, collective_table.FILE), "rb") as fh:
        table = collective_table.decode(fh.read(), collective_table.FILE)
    assert sorted(table.rows["group_seq"][table.rows["state"] == 2].tolist()) == seqs
    result = analyze(str(tmp_path / "rdr"))
    assert result.consistent and not result.mismatches, result.verdict
    assert result.ranks[0].last_collective is not None

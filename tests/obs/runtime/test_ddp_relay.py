"""DDP's buckets through obs's relay reduce to the bits DDP's own C++ reduction gives (3 gloo ranks: a group size
that is not a power of two, where dividing and multiplying by the reciprocal differ in the last bit).  Over 20 s on
a loaded machine (15 s of CPU): three spawned processes import torch and build three DDP models each."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import obs

pytestmark = pytest.mark.slow

WORLD = 3


def _grads(way: str, rank: int) -> torch.Tensor:
    """Three steps' gradients of a DDP model: ``plain`` (DDP's C++ reduction), ``relayed`` (built while obs records),
    ``divided`` (PyTorch's allreduce_hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))
    records: list[dict] = []
    recording = obs.subscribe(obs.Event.COLLECTIVE, records.append) if way == "relayed" else contextlib.nullcontext()
    with recording:
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        assert ("_obs_relay" in ddp.__dict__) == (way == "relayed")
        if way == "divided":
            ddp.register_comm_hook(None, allreduce_hook)
        torch.manual_seed(rank + 1)
        out = []
        for _ in range(3):  # the first step, and two after DDP rebuilt its buckets
            ddp.zero_grad()
            ddp(torch.randn(7, 33)).pow(2).sum().backward()
            out.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    if way == "relayed":  # each bucket on record as it was issued
        assert [r["state"] for r in records if r["op"] == "all_reduce"] == ["scheduled", "completed"] * 3, records
    return torch.stack(out)


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        grads = {way: _grads(way, rank) for way in ("plain", "relayed", "divided")}
        if rank == 0:
            torch.save(grads, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_relay_reduces_to_ddps_own_bits(tmp_path):
    out = str(tmp_path / "grads.pt")
    mp.spawn(_rank, args=(str(tmp_path / "store"), out), nprocs=WORLD, join=True)
    grads = torch.load(out)
    assert torch.equal(grads["relayed"], grads["plain"])
    assert not torch.equal(grads["divided"], grads["plain"])  # the case tells the two ways apart

"""The monitor's norms and its step batch, in-process: the native pass and torch's path give the same gradient, weight
and update norms (every dtype of the native pass, odd sizes, NaN and Inf, huge values, non-contiguous gradients, a
parameter whose memory moves); a step's device tensors travel as one batch whose event the reader waits for."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from obs.features.monitor import batch
from obs.features.monitor.activations import Activations
from obs.features.monitor.norms import RUNS, ParamNorms, sample_layout
from obs.features.monitor.stats import NORM

pytestmark = pytest.mark.native("STATS")

SIZES = [0, 1, 7, 511, 512, 513, 4096, 4097, 70_001, 200_704]


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(dtype) for n in SIZES] + [torch.randn(64, 33, generator=gen).to(dtype)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    return params


def _sample(p, sample):
    runs, length, spacing = sample_layout(p.numel(), sample)
    flat = p.detach().reshape(-1).float()
    return torch.cat([flat[r * spacing:r * spacing + length] for r in range(runs)]) if runs else flat[:0]


def _norms(params, sample, change):
    """gradient, update and weight norms through ParamNorms around an in-place change of the parameters."""
    norms = ParamNorms(params, sample)
    pending = norms.before([p.grad for p in params])
    with torch.no_grad():
        for p in params:
            change(p)
    got = norms.after(pending)
    return norms, [float(v) for v in got]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sample", [0, 4096])
def test_native_and_torch_norms_agree_with_a_plain_reference(native_path, dtype, sample):
    params = _params(dtype)
    before = [_sample(p, sample) for p in params]
    norms, got = _norms(params, sample, lambda p: p.mul_(0.75))
    assert (norms._lib is not None) == (native_path == "native")
    n = len(params)
    grads = [torch.linalg.vector_norm(p.grad.float()).item() for p in params]
    weights = [torch.linalg.vector_norm(b).item() for b in before]
    updates = [torch.linalg.vector_norm(b - _sample(p, sample)).item() for b, p in zip(before, params)]
    assert got[:n] == pytest.approx(grads, rel=1e-5)
    assert got[n:2 * n] == pytest.approx(updates, rel=1e-4, abs=1e-6)
    assert got[2 * n:] == pytest.approx(weights, rel=1e-5)
    for p, scale in zip(params, norms.scales):
        runs, length, _ = sample_layout(p.numel(), sample)
        assert scale == pytest.approx(math.sqrt(p.numel() / (runs * length)) if runs * length else 1.0)


def test_sample_layout():
    assert sample_layout(100, 0) == (1, 100, 100)
    assert sample_layout(4096, 4096) == (1, 4096, 4096)
    assert sample_layout(200_704, 4096) == (RUNS, 4096 // RUNS, 200_704 // RUNS)
    runs, length, spacing = sample_layout(4097, 4096)
    assert runs * length <= 4096 and (runs - 1) * spacing + length <= 4097


def test_nan_inf_huge_values_and_non_contiguous_gradients(native_path):
    params = [torch.ones(1000) for _ in range(3)] + [torch.ones(50, 20)]
    params[0].grad = torch.ones(1000).index_fill_(0, torch.tensor([500]), math.nan)
    params[1].grad = torch.ones(1000).index_fill_(0, torch.tensor([3]), math.inf)
    params[2].grad = torch.full((1000,), 1e30)  # squares overflow float32: the native pass sums them in double
    params[3].grad = torch.ones(20, 50).t()  # not contiguous: torch's norm for it
    _, got = _norms(params, 0, lambda p: None)
    assert math.isnan(got[0]) and got[1] == math.inf
    # torch's float32 norm overflows (inf); the native pass gives the norm
    assert got[2] == (pytest.approx(1e30 * math.sqrt(1000), rel=1e-6) if native_path == "native" else math.inf)
    assert got[3] == pytest.approx(math.sqrt(1000))
    assert got[4:8] == [0.0] * 4


def test_a_parameter_whose_memory_moves_is_measured_where_it_is(native_path):
    p = torch.nn.Parameter(torch.ones(10_000))
    p.grad = torch.ones(10_000)
    norms = ParamNorms([p], 4096)
    norms.after(norms.before([p.grad]))
    p.data = torch.full((10_000,), 2.0)  # between steps: new memory
    pending = norms.before([p.grad])
    with torch.no_grad():
        p.add_(1.0)
    got = [float(v) for v in norms.after(pending)]
    assert got[2] == pytest.approx(2.0 * math.sqrt(4096 // RUNS * RUNS))  # the new memory's values
    assert got[1] == pytest.approx(math.sqrt(4096 // RUNS * RUNS))


def test_activation_norms_native_and_torch(native_path):
    acts = Activations(NORM, 1e-8, struct=False)
    x = torch.randn(8, 16)
    half = torch.randn(8, 16).half()
    acts.record("fc", (x,), half)
    acts.record("fc", (x.t(),), x)  # a non-contiguous input: torch's path for this call
    block, parts = acts.take(NORM)
    values = [v for part in parts for v in (part.tolist() if hasattr(part, "tolist") else part)]
    assert [r[:2] for r in block.rows] == [("fc.input", 0), ("fc.output", 0), ("fc.input", 1), ("fc.output", 1)]
    assert block.rows[1][2:] == ("[8, 16]", "torch.float16")
    expected = [torch.linalg.vector_norm(t.float()).item() for t in (x, half, x, x)]
    assert values == pytest.approx(expected, rel=1e-5)
    assert acts.take(NORM) is None
    acts.record("fc", (x,), half)
    acts.record("fc", (x.t(),), x)
    again, _ = acts.take(NORM)
    assert again.rows is block.rows  # the same calls: the same tuple, by which the worker knows the layout
    acts.record("fc", (x,), half)
    assert acts.take(NORM)[0].rows == block.rows[:2]


class _Event:
    def __init__(self):
        self.waited_on: list[str] = []

    def synchronize(self):
        self.waited_on.append(threading.current_thread().name)


def test_device_parts_join_one_batch_read_after_its_event():
    """On CUDA, to_host joins the step's device tensors into one pinned copy with an event; here the same join runs
    with CPU tensors standing for device ones and a stand-in event: order kept, one copy, the reader waits on it."""
    event, copies = _Event(), []

    def copy(joined):
        copies.append(joined)
        return batch.HostCopy(joined.clone(), event)

    values = [torch.tensor([1.0, 2.0]), [3.0], torch.tensor(4.0, dtype=torch.float64), torch.tensor([5, 6])]
    out = batch.join(values, lambda v: isinstance(v, torch.Tensor) and v.dtype != torch.int64, copy)
    assert len(copies) == 1 and copies[0].tolist() == [1.0, 2.0, 4.0]
    assert out[1] == [3.0] and out[3] is values[3]
    assert not event.waited_on  # nothing waits on the training thread
    read: list[list[float]] = []
    reader = threading.Thread(target=lambda: read.extend([out[0].tolist(), out[2].tolist()]), name="reader")
    reader.start()
    reader.join()
    assert read == [[1.0, 2.0], [4.0]] and event.waited_on == ["reader"]  # once, on the reader's thread
    assert batch.to_host(values) is values  # no CUDA tensor: nothing joined


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_steps_values_are_one_pinned_copy(tmp_path, monkeypatch):
    """On a GPU: one pinned copy per collected step, and the same norms as torch's."""
    import json

    import obs
    from obs.features.monitor.feature import feature
    from obs.features.monitor.reader import read_run

    copies = []
    real = batch._pinned_copy
    monkeypatch.setattr(batch, "_pinned_copy", lambda joined: copies.append(joined.numel()) or real(joined))
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out")}}))
    obs.set_context(env_config_path=str(config))
    model = torch.nn.Linear(8, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 8, device="cuda")).pow(2).mean().backward()
        expected = torch.linalg.vector_norm(model.weight.grad).item()
        opt.step()
        opt.zero_grad()
    assert feature.monitor is not None and feature.monitor.flush(30.0)
    assert len(copies) == 3
    grads = [s for s in read_run(feature.monitor.folder).series if s.prefix == "grad_reduced" and s.name == "weight"]
    assert grads and grads[0].values[-1] == pytest.approx(expected, rel=1e-4)

"""End to end on CPU: a CUDA fault's exception (PyTorch's real types, CUDA's real messages) raised in a training run
under the recorder; the bundle on disk names the kind, the module that raised and the ops before it, an OOM's bundle
holds a memory summary, and ``obs rdr show`` says it all.  The same on a real device: tests/gpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import obs
from obs.features.rdr.cuda_memory import NO_CUDA
from recorder.bundle_reader import list_bundles, load_bundle
from tests.obs.cli.test_cli import obs_cli
from tests.recorder.test_device_faults import ASSERT, OOM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Net(torch.nn.Module):
    """An embedding then a head; ``fail`` makes one of them raise a CUDA fault's exception."""

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 2)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.fail == "oom":
            raise torch.OutOfMemoryError(OOM)  # as the allocator raises it from inside the head's matmul
        out = self.head(h)
        if self.fail == "assert":
            raise torch.AcceleratorError(ASSERT)  # the embedding's assert surfacing later, at the head's output
        return out


def configure(tmp_path, granularity="op"):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": granularity}}))
    obs.set_context(env_config_path=str(config))


def train_then_fail(fail: str) -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
    net.fail = fail
    with pytest.raises(RuntimeError):
        net(torch.tensor([4, 5]))


def only_bundle(tmp_path):
    (info,) = list_bundles(str(tmp_path / "rdr")).bundles
    return load_bundle(info.path)


def test_an_oom_in_forward_names_the_module_and_the_ops_and_has_a_memory_summary(tmp_path):
    configure(tmp_path)
    train_then_fail("oom")
    obs.reset_context()
    b = only_bundle(tmp_path)
    fault = b.device_fault
    assert b.info.reason == "module_error" and fault is not None and fault.kind == "cuda_oom"
    assert b.manifest["device_fault"] == {"kind": "cuda_oom", "title": "CUDA out of memory", "asynchronous": False,
                                          "module": "Default/net-Net"}
    assert fault.module == "Default/net-Net" and fault.surfaced_at["function"] == "forward"
    names = [(op["name"], op["scope"]) for op in fault.ops]
    assert ("embedding", "Default/net-Net/emb-Embedding") in names
    assert fault.memory_summary == NO_CUDA and fault.memory_snapshot is None  # no CUDA here: said, not a crash
    shown = obs_cli("rdr", "show", b.info.path)
    assert shown.returncode == 0, shown.stderr
    for text in ("device fault", "CUDA out of memory in Default/net-Net", "── device fault: CUDA out of memory ──",
                 "embedding", "memory summary: "):
        assert text in shown.stdout, text
    data = json.loads(obs_cli("rdr", "show", b.info.path, "--json").stdout)
    assert data["device_fault"]["kind"] == "cuda_oom" and data["device_fault"]["memory_summary"] == NO_CUDA


def test_an_assert_surfacing_later_names_the_ops_launched_before_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    configure(tmp_path)
    train_then_fail("assert")
    obs.reset_context()
    b = only_bundle(tmp_path)
    fault = b.device_fault
    assert fault.kind == "device_assert" and fault.asynchronous and fault.launch_blocking is False
    assert os.path.exists(os.path.join(b.info.path, "device_fault.txt"))
    last = [(op["name"], op["scope"]) for op in fault.ops if not op["nested"]][-3:]
    assert last == [("embedding", "Default/net-Net/emb-Embedding"), ("linear", "Default/net-Net/head-Linear"),
                    ("add.Tensor", "Default/net-Net/head-Linear")] or ("linear", "Default/net-Net/head-Linear") in last
    assert any("CUDA_LAUNCH_BLOCKING=1" in line for line in fault.advice)
    shown = obs_cli("rdr", "show", b.info.path).stdout
    assert "device-side assert in Default/net-Net; reported after the kernel failed" in shown
    assert "CUDA_LAUNCH_BLOCKING=1" in shown


def test_at_module_granularity_the_modules_before_it_are_named(tmp_path):
    configure(tmp_path, granularity="module")
    train_then_fail("assert")
    obs.reset_context()
    fault = only_bundle(tmp_path).device_fault
    assert fault.ops == [] and fault.modules[-2:] == ["Default/net-Net/emb-Embedding", "Default/net-Net/head-Linear"]


def test_a_plain_error_has_no_device_fault(tmp_path):
    configure(tmp_path)
    with pytest.raises(RuntimeError):
        torch.nn.Linear(4, 2)(torch.ones(3, 5))
    obs.rdr.dump("after")
    obs.reset_context()
    for info in list_bundles(str(tmp_path / "rdr")).bundles:
        b = load_bundle(info.path)
        assert b.device_fault is None and b.manifest["device_fault"] is None and not b.has("device_fault.json")


SCRIPT = textwrap.dedent("""
    import torch

    net = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        loss = net(torch.tensor([1, 2, 3])).sum()
        loss.backward()
        opt.step()
        if step == 2:  # as loss.item() would raise it: after the kernels, outside any module
            raise torch.AcceleratorError({message!r})
""")


@pytest.mark.slow
def test_under_obs_run_an_uncaught_assert_at_an_unrelated_call_is_named(tmp_path):
    (tmp_path / "obs.json").write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"),
                                                           "granularity": "op"}}))
    (tmp_path / "train.py").write_text(SCRIPT.format(message=ASSERT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_RDR", "OBS_", "CUDA_LAUNCH"))
           or k.startswith("OBS_NATIVE")}
    result = subprocess.run([sys.executable, "-m", "obs", "run", "--config", "obs.json", "train.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240, env={**env, "PYTHONPATH": ROOT})
    assert result.returncode == 1 and "device-side assert triggered" in result.stderr
    b = only_bundle(tmp_path)
    fault = b.device_fault
    assert b.info.reason == "exception" and fault.kind == "device_assert" and fault.module is None
    assert fault.surfaced_at["file"] == str(tmp_path / "train.py") and fault.surfaced_at["line"] == 11
    # the newest ops are the optimizer's; the ops since the last wait for the device (none here: the whole ring),
    # by module, name the embedding
    suspects = {m["scope"]: m["names"] for m in fault.suspects}
    assert suspects["Default/net-Sequential/0-Embedding"] == ["embedding"]
    assert fault.ops_since_wait == sum(m["ops"] for m in fault.suspects)
    text = (tmp_path / b.info.path / "device_fault.txt").read_text()
    assert "surfaced at " + str(tmp_path / "train.py") + ":11 in <module>" in text

"""A feature that sees less inside compiled code says so once, at the first compile, and not without one."""

from __future__ import annotations

import json
import logging

import torch

import obs
from obs._core.events import Event, bus
from obs.features import compiled_notice
from tests.obs.features.dump.test_reader_cli import dump_config


def test_each_feature_says_once_what_it_cannot_see_in_compiled_code(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(compiled_notice, "_said", set())
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"nan_check": {"enable": True, "path": str(tmp_path)},
                               "exception_dump": {"enable": True, "path": str(tmp_path)},
                               "rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    obs.set_context(env_config_path=str(cfg))
    model = torch.nn.Linear(4, 2)
    with caplog.at_level(logging.WARNING, logger="obs"):
        model(torch.randn(2, 4)).sum().backward()  # eager: nothing to say
        assert not caplog.records
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            compiled(torch.randn(2, 4)).sum().backward()
        torch._dynamo.reset()
        torch.compile(torch.nn.Linear(4, 2), backend="aot_eager")(torch.randn(2, 4))  # a second compile
    said = [r.getMessage() for r in caplog.records]
    assert sorted(m.split(" with torch.compile")[0] for m in said) == [
        "obs: exception_dump", "obs: the NaN/Inf check", "obs: the Running Data Recorder"]
    assert all("compiled module" in m for m in said)


def test_the_data_dumps_notice_waits_for_an_inductor_compile(tmp_path, caplog, monkeypatch):
    """Tensors inside compiled graphs go unsaved only where Inductor fuses them: not with aot_eager."""
    monkeypatch.setattr(compiled_notice, "_said", set())
    obs.set_context(env_config_path=str(dump_config(tmp_path / "dump", "tensor")))
    with caplog.at_level(logging.WARNING, logger="obs"):
        torch._dynamo.reset()
        torch.compile(torch.nn.Linear(4, 2), backend="aot_eager")(torch.randn(2, 4)).sum().backward()
        torch._dynamo.reset()
        assert not [r for r in caplog.records if "data dump" in r.getMessage()]
        # what an Inductor compile records (compiled or loaded from its cache), without paying for one
        bus.emit(Event.COMPILE_RECORD, "0/0", "inductor_output_code", {}, "")
    said = [r.getMessage() for r in caplog.records if "data dump" in r.getMessage()]
    assert len(said) == 1 and "Inductor-compiled graphs are not saved" in said[0]

"""The torch versions obs supports: an older torch is refused at the first set_context with the version and the
range, before anything is applied; a newer one is warned about once; the installed one passes."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys

import pytest
import torch

import obs
from obs.runtime import torch_support


def test_the_installed_torch_is_supported(caplog):
    with caplog.at_level(logging.WARNING, logger="obs"):
        torch_support.check()
    assert torch_support.installed() == torch.__version__ and not caplog.records
    assert torch_support.OLDEST <= tuple(int(n) for n in torch.__version__.split(".")[:2]) <= torch_support.NEWEST


def test_torch_is_importable_here_and_not_where_it_is_neither_imported_nor_found(monkeypatch):
    assert torch_support.importable()
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torch" else pytest.fail(name))
    assert not torch_support.importable()


@pytest.mark.parametrize("version", ["2.9.0", "2.9.0a0+git1234567", "2.13.0+cpu", "2.14.1+cu130"])
def test_versions_inside_the_range_pass_quietly(version, caplog):
    with caplog.at_level(logging.WARNING, logger="obs"):
        torch_support.check(version)
    assert not caplog.records


@pytest.mark.parametrize("version", ["2.8.1", "2.1.0+cu121", "1.13.1"])
def test_an_older_torch_is_refused_naming_the_version_and_the_range(version):
    with pytest.raises(obs.ObsError, match=re.escape(f"this is torch {version}")) as caught:
        torch_support.check(version)
    assert "torch 2.9 to 2.14.x" in str(caught.value) and "pip install 'torch>=2.9'" in str(caught.value)


def test_set_context_refuses_an_older_torch_and_applies_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(torch_support, "installed", lambda: "2.8.0")
    with pytest.raises(obs.ObsError, match=r"obs needs torch 2\.9 to 2\.14\.x .*this is torch 2\.8\.0"):
        obs.set_context(print_file_path=str(tmp_path / "print.pb"))
    assert obs.get_context("print_file_path") == ""
    monkeypatch.setattr(torch_support, "installed", lambda: torch.__version__)
    obs.set_context(print_file_path=str(tmp_path / "print.pb"))
    assert obs.get_context("print_file_path") == str(tmp_path / "print.pb")


def test_a_newer_or_unreadable_torch_is_warned_about_once_and_obs_runs(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(torch_support, "_warned", set())
    monkeypatch.setattr(torch_support, "installed", lambda: "2.15.0")
    with caplog.at_level(logging.WARNING, logger="obs"):
        obs.set_context(print_file_path=str(tmp_path / "print.pb"))
        torch_support.check()
        torch_support.check("nightly")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "torch 2.15.0 is newer than obs was tested with" in said[0]
    assert "tested: 2.13.0, 2.14.1" in said[0] and "torch nightly is a version obs cannot read" in said[1]
    assert obs.get_context("print_file_path") == str(tmp_path / "print.pb")

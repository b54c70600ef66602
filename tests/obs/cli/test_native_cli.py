"""``obs native status | build``: each extension's state, JSON for machines, exit 1 only when one is unavailable."""

from __future__ import annotations

import json

from obs._core import native
from obs.cli import main


def _status(capsys, *argv):
    code = main(["native", *argv, "--json"])
    return code, {e["name"]: e for e in json.loads(capsys.readouterr().out)["extensions"]}


def test_a_switched_off_part_is_said_so_and_is_no_failure(capsys, monkeypatch):
    monkeypatch.setenv("OBS_NATIVE_DUMP", "0")
    code, by_name = _status(capsys, "status")
    assert code == 0
    for name in ("obs_dump_rows", "obs_dump_nan"):
        assert by_name[name]["state"] == "switched off" and not by_name[name]["in_use"]
        assert by_name[name]["reason"] == "OBS_NATIVE_DUMP=0 asks for the Python path"
    assert by_name["recorder._hotpath"]["part"] == "RECORDER"


def test_an_extension_that_cannot_load_fails_build_with_its_reason(capsys, monkeypatch, tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("// never compiled: requires() refuses first\n")
    monkeypatch.setattr(native, "EXTENSIONS", dict(native.EXTENSIONS))  # the test's extension leaves with it
    native.Extension("obs_test_broken", "test extension", (str(source),), part="DUMP", fallback="a test",
                     requires=lambda: "the test says it cannot")
    monkeypatch.delenv("OBS_NATIVE", raising=False)
    monkeypatch.delenv("OBS_NATIVE_DUMP", raising=False)
    code, by_name = _status(capsys, "status")
    assert code == 0 and by_name["obs_test_broken"]["state"] == "not built yet"
    code, by_name = _status(capsys, "build")
    assert code == 1
    assert by_name["obs_test_broken"] == {"name": "obs_test_broken", "part": "DUMP", "built_at": "first use",
                                          "state": "unavailable", "reason": "the test says it cannot",
                                          "in_use": False}


def test_status_lists_every_extension_setup_py_builds(capsys):
    """``obs native status`` (and the wheel check that relies on it) covers every C module setup.py builds."""
    import pathlib
    import re

    setup = (pathlib.Path(__file__).resolve().parents[3] / "setup.py").read_text()
    built = set(re.findall(r'Extension\("([\w.]+)"', setup))
    _, listed = _status(capsys, "status")
    assert built and built <= set(listed), built - set(listed)

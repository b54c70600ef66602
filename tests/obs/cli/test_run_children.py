"""``obs run``'s script, run again by a process it starts (as Lightning's DDP launcher starts its other ranks), runs
under obs with the same settings; other Python processes it starts do not import obs; a ``sitecustomize`` already on
``PYTHONPATH`` still runs in each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = """\
import builtins, json, os, subprocess, sys
import obs

print(json.dumps({"child": bool(os.environ.get("CHILD")), "argv": sys.argv[1:],
                  "hidden": builtins.HIDDEN == os.getpid(), "op_timeout": obs.get_context("op_timeout"),
                  "rdr": obs.rdr.recorder() is not None}), flush=True)
if not os.environ.get("CHILD"):
    here = os.path.abspath(__file__)
    subprocess.run([sys.executable, here, *sys.argv[1:]], env={**os.environ, "CHILD": "1"}, cwd="elsewhere", check=True)
    subprocess.run([sys.executable, "-c", "import builtins, os, sys; "
                    "print({'other_imports_obs': 'obs' in sys.modules, 'hidden': builtins.HIDDEN == os.getpid()})"],
                   check=True)
"""


@pytest.mark.slow
def test_a_child_that_runs_the_script_again_runs_under_obs_with_the_same_settings(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "obs.json").write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    (tmp_path / "elsewhere").mkdir()  # the child's working folder: the config's relative path still holds
    hidden = tmp_path / "site"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import builtins, os\nbuiltins.HIDDEN = os.getpid()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_RDR", "OBS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), ROOT])
    result = subprocess.run([sys.executable, "-m", "obs", "run", "--config", "obs.json", "--set", "op_timeout=77",
                             "train.py", "a", "--b"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    parent, child = (json.loads(line) for line in lines[:2])
    assert parent == {"child": False, "argv": ["a", "--b"], "hidden": True, "op_timeout": 77, "rdr": True}
    assert child == {**parent, "child": True}
    assert lines[2] == "{'other_imports_obs': False, 'hidden': True}"

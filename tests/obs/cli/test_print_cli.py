"""``obs print``: pretty, JSON lines, partial files, follow, and its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from printsink.encoder import CallMeta, encode_bytes
from printsink.values import normalize
from tests.obs.cli.test_cli import obs_cli


def _write(path, calls):
    data = b"".join(encode_bytes(normalize(v), CallMeta(i + 1, 1_795_000_000_000_000_000, 5, 0, 42, "train.py:9",
                                                        len(normalize(v)))) for i, v in enumerate(calls))
    path.write_bytes(data)
    return data


def test_pretty_output(tmp_path):
    path = tmp_path / "p.pb"
    _write(path, [("x is:", np.arange(6, dtype=np.float32).reshape(2, 3), 2.5)])
    result = obs_cli("print", str(path))
    assert result.returncode == 0, result.stderr
    assert "#1  step 5  rank 0  pid 42" in result.stdout and "train.py:9" in result.stdout
    assert "Tensor(shape=[2, 3], dtype=Float32, value=" in result.stdout and "\n2.5\n" in result.stdout


def test_json_lines(tmp_path):
    path = tmp_path / "p.pb"
    _write(path, [("a", np.array([1.0, np.nan, np.inf])), ("b", np.complex64(1 + 2j))])
    result = obs_cli("print", str(path), "--json")
    assert result.returncode == 0, result.stderr
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["seq"] == 1 and first["values"][1] == {"type": "tensor", "dtype": "Float64", "shape": [3],
                                                        "value": [1.0, "nan", "inf"]}
    assert second["values"][1]["value"] == [1.0, 2.0] and second["values"][1]["dtype"] == "Complex64"


def test_truncated_file_fails_and_partial_shows_the_complete_calls(tmp_path):
    path = tmp_path / "p.pb"
    data = _write(path, [("one",), ("two", np.ones(100))])
    path.write_bytes(data[:-5])
    result = obs_cli("print", str(path))
    assert result.returncode == 1 and "--partial" in result.stderr and "Traceback" not in result.stderr
    result = obs_cli("print", str(path), "--partial", "--json")
    assert result.returncode == 0 and [json.loads(x)["values"][0]["value"] for x in result.stdout.splitlines()] \
        == ["one"]
    assert "warning" in result.stderr and "after 1 complete record" in result.stderr


def test_corrupt_and_missing_files(tmp_path):
    path = tmp_path / "p.pb"
    path.write_bytes(b"\x00garbage")
    result = obs_cli("print", str(path))
    assert result.returncode == 1 and "corrupt at byte offset 0" in result.stderr
    result = obs_cli("print", str(tmp_path / "missing.pb"))
    assert result.returncode == 2 and "missing.pb" in result.stderr and "Traceback" not in result.stderr


def test_follow_shows_calls_while_a_job_writes(tmp_path):
    path = tmp_path / "live.pb"
    path.write_bytes(b"")
    proc = subprocess.Popen([sys.executable, "-m", "obs", "print", str(path), "--follow", "--json"],
                            stdout=subprocess.PIPE, text=True)
    try:
        with open(path, "ab") as f:
            for i in range(3):
                f.write(encode_bytes(normalize((f"call {i}",)), CallMeta(i, 0, i, 0, 1, "", 1)))
                f.flush()
                time.sleep(0.1)
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert [line["values"][0]["value"] for line in lines] == ["call 0", "call 1", "call 2"]


def test_demo_writes_print_records_and_points_to_obs_print(tmp_path):
    path = tmp_path / "demo.pb"
    result = obs_cli("demo", "--steps", "12", "--set", f"print_file_path={path}", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["next_commands"][0] == f"obs print {path}" and str(path) in data["produced"][0]
    from printsink.reader import iter_print

    calls = list(iter_print(path))
    assert [c.values[0] for c in calls] == ["step 1 loss:", "step 11 loss:"]
    assert calls[0].values[3].shape == (4,) and "_demo.py:" in calls[0].meta.source

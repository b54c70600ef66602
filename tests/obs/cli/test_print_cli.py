"""``obs print``: pretty, JSON lines, partial files, follow, and its exit codes (in this process; follow, a closed
pipe and the demo as real processes)."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from printsink.encoder import CallMeta, encode_bytes
from printsink.values import normalize
from tests.obs.cli.test_cli import obs_cli, obs_process


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
    data = _write(path, [("one",), ("two",)])
    path.write_bytes(data + b"\x00garbage")
    result = obs_cli("print", str(path))
    assert result.returncode == 1 and f"corrupt at byte offset {len(data)}" in result.stderr
    assert "--partial" in result.stderr and "Traceback" not in result.stderr
    path.write_bytes(b"\x00garbage")
    result = obs_cli("print", str(path))
    assert result.returncode == 2 and "is not a print file" in result.stderr
    result = obs_cli("print", str(tmp_path / "missing.pb"))
    assert result.returncode == 2 and "missing.pb" in result.stderr and "Traceback" not in result.stderr


def test_follow_shows_calls_while_a_job_writes(tmp_path):
    """Started before the job's first Print: waits for the file, then shows each call as it lands."""
    path = tmp_path / "live.pb"
    proc = subprocess.Popen([sys.executable, "-m", "obs", "print", str(path), "--follow", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Write only once it said it waits (a fixed sleep raced a slow start on a loaded machine: the file was there)
        ready, _, _ = select.select([proc.stderr], [], [], 120)
        waiting = proc.stderr.readline() if ready else ""
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
        err = proc.stderr.read()
        proc.stderr.close()
    assert [line["values"][0]["value"] for line in lines] == ["call 0", "call 1", "call 2"]
    assert "does not exist yet: waiting for it" in waiting, (waiting, err)


def test_demo_writes_print_records_and_points_to_obs_print(tmp_path):
    path = tmp_path / "demo.pb"
    result = obs_process("demo", "--steps", "12", "--set", f"print_file_path={path}", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["next_commands"][0] == f"obs print {path}" and str(path) in data["produced"][0]
    from printsink.reader import iter_print

    calls = list(iter_print(path))
    assert [c.values[0] for c in calls] == ["step 1 loss:", "step 11 loss:"]
    assert calls[0].values[3].shape == (4,) and "_demo.py:" in calls[0].meta.source


def test_a_text_file_is_not_a_print_file_exit_2(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# obs\n\nAn observability runtime for PyTorch.\n")
    result = obs_cli("print", str(readme))
    assert result.returncode == 2 and "is not a print file" in result.stderr and "corrupt" not in result.stderr
    (tmp_path / "empty.pb").write_bytes(b"")
    result = obs_cli("print", str(tmp_path / "empty.pb"))
    assert result.returncode == 2 and "is not a print file" in result.stderr


def test_partial_skips_a_damaged_record_mid_file_and_says_how_much(tmp_path):
    path = tmp_path / "p.pb"
    records = [encode_bytes(normalize((f"call {i}", np.full(3, i, "<i4"))), CallMeta(i, 0, 0, 0, 1, "", 2))
               for i in range(5)]
    bad = bytearray(records[2])
    bad[bad.index(b"Int32")] = ord("X")
    path.write_bytes(b"".join(records[:2]) + bytes(bad) + b"".join(records[3:]))
    result = obs_cli("print", str(path))
    assert result.returncode == 1 and "corrupt at byte offset" in result.stderr and "truncated" not in result.stderr
    result = obs_cli("print", str(path), "--partial", "--json")
    assert result.returncode == 0, result.stderr
    assert [json.loads(x)["values"][0]["value"] for x in result.stdout.splitlines()] == \
        ["call 0", "call 1", "call 3", "call 4"]
    assert f"skipped 1 damaged record(s), {len(bad)} byte(s)" in result.stderr


def test_control_characters_from_the_file_are_escaped(tmp_path):
    path = tmp_path / "p.pb"
    path.write_bytes(encode_bytes(normalize(("\x1b[2J\x1b]0;pwned\x07 hello",)),
                                  CallMeta(1, 0, 0, 0, 1, "evil\x1b[31m.py:1", 1)))
    result = obs_cli("print", str(path))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b[2J" in result.stdout and "evil\\x1b[31m.py:1" in result.stdout
    result = obs_cli("print", str(path), "--json")
    assert json.loads(result.stdout)["values"][0]["value"].startswith("\x1b[2J")


@pytest.mark.parametrize("flags", [["--json"], []], ids=["json", "human"])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, flags):
    """``obs print FILE [--json] | head -1``: one line out, no error, exit 0 (rich alone would exit 1)."""
    path = tmp_path / "p.pb"
    _write(path, [(f"call {i}", np.arange(2000, dtype=np.float32)) for i in range(300)])
    cmd = f"{sys.executable} -m obs print {path} {' '.join(flags)} | head -1; echo \"rc=${{PIPESTATUS[0]}}\" >&2"
    result = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert len(result.stdout.splitlines()) == 1
    if flags:
        assert json.loads(result.stdout)["values"][0]["value"] == "call 0"
    else:
        assert result.stdout.startswith("#1  step 5")
    assert result.stderr.strip() == "rc=0", result.stderr


def test_json_of_a_large_tensor_is_streamed_and_exact(tmp_path):
    path = tmp_path / "p.pb"
    big = np.arange(300_000, dtype=np.float32).reshape(1000, 300)
    big[5, 7] = np.nan
    _write(path, [("big", big, np.arange(200_000, dtype=np.int8))])
    result = obs_cli("print", str(path), "--json")
    assert result.returncode == 0, result.stderr
    value = json.loads(result.stdout)["values"][1]
    assert value["shape"] == [1000, 300] and value["value"][5][7] == "nan" and value["value"][999][299] == 299_999.0
    assert len(json.loads(result.stdout)["values"][2]["value"]) == 200_000

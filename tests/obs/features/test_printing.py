"""obs.Print end to end: print_file_path rules, screen output, events, threads, processes, compiled graphs."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import obs
from obs.features.printing import ENV_PRINT_FILE, feature
from printsink.reader import iter_print
from tests.printsink.print_pb2 import Print as MindSporePrint


def test_file_gets_every_value_and_mindspore_parses_it(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    obs.Print("x is:", x, "scalar:", 2.5, torch.tensor(3, dtype=torch.int32), torch.tensor([True, False]))
    obs.ops.Print()("loss", (np.float16(0.5), [1, 2]))
    obs.reset_context()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    parsed = obs.parse_print(path)
    assert parsed[0] == "x is:" and np.array_equal(parsed[1], x.numpy()) and parsed[3].item() == 2.5
    assert parsed[2] == "scalar:" and parsed[4].item() == 3 and parsed[5].tolist() == [True, False]
    assert parsed[6] == "loss" and parsed[7].dtype == np.float16 and [p.item() for p in parsed[8:]] == [1, 2]
    merged = MindSporePrint.FromString(path.read_bytes())
    assert [v.tensor.tensor_type for v in merged.value if v.HasField("tensor")] == \
        ["Float32", "Float64", "Int32", "Bool", "Float16", "Int64", "Int64"]


def test_metadata_says_when_and_where(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    with obs.step():
        before = time.time_ns()
        obs.Print("in step")
        line = sys._getframe().f_lineno - 1
    obs.reset_context()
    (call,) = iter_print(path)
    assert call.meta.step == 1 and call.meta.pid == os.getpid() and call.meta.rank == 0
    assert call.meta.source == f"{__file__}:{line}" and before <= call.meta.time_ns <= time.time_ns()


def test_existing_file_is_kept_and_output_goes_to_a_timestamped_name(tmp_path):
    path = tmp_path / "print.pb"
    path.write_bytes(b"precious")
    obs.set_context(print_file_path=str(path))
    obs.Print("new")
    target = feature.writer.path
    obs.reset_context()
    assert path.read_bytes() == b"precious"
    name, _, stamp = os.path.basename(target).rpartition(".")
    assert name == "print.pb" and abs(int(stamp) - time.time()) < 5
    assert obs.parse_print(target) == ["new"]


def test_existing_timestamped_name_too_is_a_value_error(tmp_path, monkeypatch):
    path = tmp_path / "print.pb"
    path.write_bytes(b"a")
    monkeypatch.setattr(time, "time", lambda: 1795351692.5)
    (tmp_path / "print.pb.1795351692").write_bytes(b"b")
    with pytest.raises(ValueError, match=r"print.pb.1795351692' that output would go to instead"):
        obs.set_context(print_file_path=str(path))
    assert obs.get_context("print_file_path") == "" and feature.writer is None


def test_directory_is_an_is_a_directory_error(tmp_path):
    with pytest.raises(IsADirectoryError, match="print_file_path must be a file path"):
        obs.set_context(print_file_path=str(tmp_path))


def test_empty_path_is_unset_as_get_context_returns_it(tmp_path):
    obs.set_context(print_file_path=str(tmp_path / "p.pb"))
    obs.set_context(print_file_path="")
    assert obs.get_context("print_file_path") == "" and feature.path is None


def test_a_failing_call_creates_no_file(tmp_path):
    path = tmp_path / "sub" / "print.pb"
    with pytest.raises(ValueError):
        obs.set_context(print_file_path=str(path), save_graphs=-1)
    assert not path.parent.exists() and feature.writer is None


def test_parent_folders_are_created_private(tmp_path):
    path = tmp_path / "a" / "b" / "print.pb"
    obs.set_context(print_file_path=str(path))
    obs.Print("first")
    assert path.exists() and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_new_path_closes_the_old_file_and_reset_closes_the_new(tmp_path):
    first, second = tmp_path / "1.pb", tmp_path / "2.pb"
    obs.set_context(print_file_path=str(first))
    obs.Print("one")
    old = feature.writer
    obs.set_context(print_file_path=str(second))
    assert old.closed and os.environ[ENV_PRINT_FILE] == str(second)
    obs.Print("two")
    new = feature.writer
    obs.reset_context()
    assert new.closed and ENV_PRINT_FILE not in os.environ
    assert obs.parse_print(first) == ["one"] and obs.parse_print(second) == ["two"]


def test_screen_output_in_mindspore_style(capsys):
    obs.Print("x is:", torch.arange(6, dtype=torch.float32).reshape(2, 3), "scalar:", 2.5, torch.tensor(3))
    assert capsys.readouterr().out == ("x is:\nTensor(shape=[2, 3], dtype=Float32, value=\n[[0., 1., 2.],\n"
                                       " [3., 4., 5.]])\nscalar:\n2.5\n3\n")


def test_print_event_carries_items_and_meta(capsys):
    seen = []
    obs.subscribe(obs.Event.PRINT, lambda values, meta: seen.append((values, meta)))
    obs.Print("v", 1)
    ((values, meta),) = seen
    assert values[0] == "v" and values[1].dtype == "Int64" and meta.n_values == 2


def test_bad_values_raise_before_anything_is_written(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    with pytest.raises(TypeError, match="got dict"):
        obs.Print("ok", {"no": 1})
    assert not path.exists()


def test_threads_never_tear_records(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))

    def work(k):
        for i in range(150):
            obs.Print(f"thread {k}", np.full(1000 + k * 3000, i, dtype=np.int32))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    obs.reset_context()
    per_thread: dict[str, list[int]] = {}
    for call in iter_print(path):
        label, data = call.values
        k = int(label.split()[1])
        assert data.size == 1000 + k * 3000 and (data == data[0]).all()
        per_thread.setdefault(label, []).append(int(data[0]))
    assert all(v == list(range(150)) for v in per_thread.values()) and len(per_thread) == 6


def _fork_worker(k):
    for i in range(100):
        obs.Print(f"proc {k}", np.full(20_000, i, dtype=np.float32))
    return os.getpid()


def test_forked_processes_append_whole_records(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    with multiprocessing.get_context("fork").Pool(3) as pool:
        pids = set(pool.map(_fork_worker, range(3)))
    obs.reset_context()
    calls = list(iter_print(path))
    assert len(calls) == 300 and {c.meta.pid for c in calls} == pids
    for call in calls:
        assert (call.values[1] == call.values[1][0]).all()


class PrintingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        obs.Print("sample", i, torch.full((4,), float(i)))
        return torch.tensor(i)


def test_spawned_dataloader_workers_append_to_the_same_file(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    loader = torch.utils.data.DataLoader(PrintingDataset(), batch_size=2, num_workers=2,
                                         multiprocessing_context="spawn")
    assert sorted(int(x) for batch in loader for x in batch) == list(range(8))
    obs.reset_context()
    calls = list(iter_print(path))
    assert sorted(int(c.values[1]) for c in calls) == list(range(8))
    assert len({c.meta.pid for c in calls}) == 2 and os.getpid() not in {c.meta.pid for c in calls}
    assert {c.meta.parent_pid for c in calls} == {os.getpid()}  # obs print calls them workers
    assert sorted((c.meta.pid, c.meta.seq) for c in calls) == sorted({(c.meta.pid, c.meta.seq) for c in calls})


def test_compiled_function_prints_without_graph_break(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))

    def f(x):
        y = x * 2
        obs.Print("y is:", y, 0.5, (3, True))
        return y + 1

    print_line = f.__code__.co_firstlineno + 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for k in range(3):
        assert torch.equal(compiled(torch.full((3,), float(k))), torch.full((3,), 2.0 * k + 1))
    obs.reset_context()
    calls = list(iter_print(path))
    assert [c.values[1].tolist() for c in calls] == [[0.0] * 3, [2.0] * 3, [4.0] * 3]
    assert [c.values[0] for c in calls] == ["y is:"] * 3 and calls[0].values[2].item() == 0.5
    assert calls[0].values[3].dtype == np.int64 and calls[0].values[4].dtype == np.bool_
    assert {c.meta.source for c in calls} == {f"{__file__}:{print_line}"}  # eager mode's file:line, not a placeholder


def _print_twice(y):
    obs.Print("helper", y)


class _PrintingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        obs.Print("forward", y)
        _print_twice(y)
        return y


def test_compiled_module_records_each_call_site_inlined_frames_too(tmp_path):
    import inspect

    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    net = torch.compile(_PrintingNet(), backend="eager", fullgraph=True)
    net(torch.ones(2, 3))
    obs.reset_context()
    forward_line = inspect.getsourcelines(_PrintingNet.forward)[1] + 2
    helper_line = _print_twice.__code__.co_firstlineno + 1
    assert [(c.values[0], c.meta.source) for c in iter_print(path)] == [
        ("forward", f"{__file__}:{forward_line}"), ("helper", f"{__file__}:{helper_line}")]


_LIMIT = 60_000  # the disk-full test's file size limit (RLIMIT_FSIZE)


@pytest.fixture(scope="module", name="printed_then_killed")
def _printed_then_killed(tmp_path_factory):
    """One process for two tests (its start-up, torch's import, is most of its cost): it prints into a file
    until the file is full (RLIMIT_FSIZE) and reports, resets the context and lifts the limit, then prints 50
    records into a second file and SIGKILLs itself right after.  The folder (full.pb, killed.pb) and the result."""
    folder = tmp_path_factory.mktemp("print-subprocess")
    script = textwrap.dedent(f"""
        import json, os, resource, signal, warnings
        import numpy as np
        import obs
        from obs.features.printing import feature
        from printsink.writer import PrintFileFullWarning
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, ({_LIMIT}, hard))
        obs.set_context(print_file_path={str(folder / "full.pb")!r})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(40):
                obs.Print("i", i, np.full(1500 + 700 * (i % 3), i, dtype=np.float32))
            obs.Print("tiny")  # fits again once the torn record is cut off
        writer = feature.writer
        print(json.dumps(dict(records=writer.records, dropped=writer.dropped_records, bytes=writer.bytes,
                              dropped_bytes=writer.dropped_bytes,
                              warnings=[str(w.category.__name__) for w in caught],
                              errors=obs.internal_error_counts())))
        obs.reset_context()
        print("full: done", flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        obs.set_context(print_file_path={str(folder / "killed.pb")!r})
        for i in range(50):
            obs.Print("i", i, np.full(10_000, i, dtype=np.float32))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    return folder, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_kill_right_after_print_loses_nothing(printed_then_killed):
    folder, result = printed_then_killed
    assert result.returncode == -signal.SIGKILL
    assert [int(c.values[1]) for c in iter_print(folder / "killed.pb")] == list(range(50))


def test_a_fault_fsyncs_the_print_file(tmp_path, monkeypatch):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    obs.Print("before the crash")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    obs.bus.emit(obs.Event.FAULT, "exception", "forward", RuntimeError("boom"))
    assert synced == [feature.writer._fd]


# --- disk full: the file keeps every whole record, Print never raises into the loop -------------------------------

def test_disk_full_cuts_back_to_the_last_whole_record_and_warns_once(printed_then_killed):
    folder, result = printed_then_killed
    path = folder / "full.pb"
    said = result.stdout.splitlines()
    assert said[1:2] == ["full: done"], result.stderr  # then the kill test's part
    report = json.loads(said[0])
    assert report["warnings"] == ["PrintFileFullWarning"] and report["errors"] == {}
    assert report["dropped"] >= 1 and report["records"] + report["dropped"] == 41
    calls = list(iter_print(path))  # strict: no torn record anywhere
    assert len(calls) == report["records"] and os.path.getsize(path) == report["bytes"] <= _LIMIT
    numbers = [int(c.values[1]) for c in calls if len(c.values) == 3]
    assert numbers == list(range(len(numbers))) and calls[-1].values == ["tiny"]
    assert "dropped" in result.stderr and f"{report['dropped']} record(s)" in result.stderr


# --- print_file_path: folders resolved, the last component never followed --------------------------------------------

def test_a_symlink_planted_at_the_path_is_sidestepped_never_followed(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "secret").write_bytes(b"secret")
    link = tmp_path / "print.pb"
    link.symlink_to(other / "secret")
    dangling = tmp_path / "new.pb"
    dangling.symlink_to(other / "created-by-follow")
    for planted in (link, dangling):
        obs.set_context(print_file_path=str(planted))
        obs.Print("x")
        written = feature.writer.path
        obs.reset_context()
        assert os.path.dirname(written) == str(tmp_path) and written.startswith(f"{planted}.")
        assert obs.parse_print(written) == ["x"] and os.path.islink(planted)
    assert sorted(os.listdir(other)) == ["secret"] and (other / "secret").read_bytes() == b"secret"


def test_a_symlink_planted_after_set_context_is_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    path.symlink_to(target)  # the race: planted between set_context and the first Print
    obs.Print("x")
    written = feature.writer.path
    obs.reset_context()
    assert target.read_bytes() == b"keep" and os.path.islink(path)
    assert written.startswith(f"{path}.") and obs.parse_print(written) == ["x"]


@pytest.mark.parametrize("kind", ["fifo", "devnull"])
def test_a_device_or_fifo_is_refused_and_nothing_is_created_beside_it(tmp_path, kind):
    if kind == "fifo":
        path = str(tmp_path / "pipe.pb")
        os.mkfifo(path)
    else:
        path = os.devnull
    before = set(os.listdir(os.path.dirname(path)))
    with pytest.raises(ValueError, match="not a regular file"):
        obs.set_context(print_file_path=path)
    assert set(os.listdir(os.path.dirname(path))) == before and feature.path is None


def test_an_over_long_path_leaves_no_folders_behind(tmp_path):
    for bad in (tmp_path / "a" / "b" / ("x" * 300), tmp_path / "a" / ("y" * 300) / "p.pb",
                tmp_path / "a" / "b" / (("c" * 100 + "/") * 45 + "p.pb")):
        with pytest.raises(ValueError, match="print_file_path"):
            obs.set_context(print_file_path=str(bad))
        assert os.listdir(tmp_path) == [] and obs.get_context("print_file_path") == ""


def test_a_name_at_the_limit_is_fine_until_its_timestamped_twin_would_be_too_long(tmp_path):
    path = tmp_path / ("n" * 255)
    obs.set_context(print_file_path=str(path))
    obs.Print("fits")
    obs.reset_context()
    assert obs.parse_print(path) == ["fits"]
    with pytest.raises(ValueError, match=r"exists, and the name output would go to instead .* is longer"):
        obs.set_context(print_file_path=str(path))
    assert obs.get_context("print_file_path") == "" and os.listdir(tmp_path) == [path.name]


def test_a_failed_first_create_removes_the_folders_it_made(tmp_path, monkeypatch):
    from obs._core import safe_files

    path = tmp_path / "a" / "b" / "print.pb"
    obs.set_context(print_file_path=str(path))
    real = safe_files.create_file

    def failing(p, **kw):
        real(str(tmp_path / "a" / "b" / "probe"), **kw)  # the folders get made ...
        os.unlink(tmp_path / "a" / "b" / "probe")
        raise OSError(28, "No space left on device")  # ... then creating the file fails

    monkeypatch.setattr(safe_files, "create_file", failing)
    with pytest.raises(OSError, match="No space"):  # the test suite raises internal errors
        obs.Print("x")
    assert os.listdir(tmp_path) == []


# --- no print, no file -----------------------------------------------------------------------------------------------

def test_no_file_until_the_first_print(tmp_path):
    path = tmp_path / "sub" / "print.pb"
    obs.set_context(print_file_path=str(path))
    assert not (tmp_path / "sub").exists() and feature.path == str(path)
    obs.reset_context()
    assert os.listdir(tmp_path) == []
    from obs._core.outputs import written

    assert ("print file", str(path)) not in written()
    obs.set_context(print_file_path=str(path))
    obs.Print("now")
    obs.reset_context()
    assert obs.parse_print(path) == ["now"] and ("print file", str(path)) in written()


# --- workers: unique (pid, seq), the parent named ---------------------------------------------------------------------

class _WorkerDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        obs.Print("sample", i)
        return torch.tensor(i)


def test_forked_dataloader_workers_have_their_own_seq_and_are_marked_as_workers(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    for _ in range(5):
        obs.Print("parent before")
    loader = torch.utils.data.DataLoader(_WorkerDataset(), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    assert sorted(int(x) for batch in loader for x in batch) == list(range(12))
    obs.Print("parent after")
    obs.reset_context()
    calls = list(iter_print(path))
    keys = [(c.meta.pid, c.meta.seq) for c in calls]
    assert len(set(keys)) == len(keys) == 18
    me = os.getpid()
    assert {c.meta.parent_pid for c in calls} == {me}
    workers = [c for c in calls if c.meta.pid != me]
    assert len({c.meta.pid for c in workers}) == 2
    for pid in {c.meta.pid for c in workers}:
        assert sorted(c.meta.seq for c in workers if c.meta.pid == pid) == list(range(1, 7))
    assert [c.meta.seq for c in calls if c.meta.pid == me] == list(range(1, 7))
    from tests.obs.cli.test_cli import obs_cli

    shown = obs_cli("print", str(path)).stdout
    assert shown.count("worker pid ") == 12 and f"(of {me}" in shown
    lines = [json.loads(x) for x in obs_cli("print", str(path), "--json").stdout.splitlines()]
    assert sum(x["worker"] for x in lines) == 12 and {x["parent_pid"] for x in lines} == {me}


# -- the step a call says ------------------------------------------------------------------------

class _StepNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        obs.Print("forward", x.shape[0])
        return self.fc(x)


def _train_printing(steps, *, evaluate_after=False):
    net = _StepNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.ones(2, 4)).sum().backward()
        opt.step()
        obs.Print("after step")
    if evaluate_after:
        with torch.no_grad():
            net(torch.ones(2, 4))


def _steps_said(path):
    return [(c.values[0], c.meta.step) for c in iter_print(path)]


def _expected(steps, *, evaluated=False):
    said = [pair for n in range(1, steps + 1) for pair in (("forward", n), ("after step", n))]
    return said + ([("forward", steps)] if evaluated else [])


def test_a_print_in_forward_says_its_own_step_without_the_rdr(tmp_path):
    """A Print in step N's forward said N-1: with Print alone, only the optimizer hooks saw steps begin."""
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    _train_printing(3, evaluate_after=True)  # an eval forward after the last step stays in it
    obs.reset_context()
    assert _steps_said(path) == _expected(3, evaluated=True)


@pytest.mark.parametrize("granularity", ["step", "module"])
def test_a_print_in_forward_says_its_own_step_with_the_rdr(tmp_path, granularity):
    from recorder.bundle_reader import load_bundle

    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"),
                                          "granularity": granularity}}))
    path = tmp_path / "print.pb"
    obs.set_context(env_config_path=str(config), print_file_path=str(path))
    _train_printing(3)
    bundle = obs.rdr.dump("prints")
    obs.reset_context()
    assert _steps_said(path) == _expected(3)
    recorded = [(e["values"][0], e["step"]) for e in load_bundle(bundle).iter_events() if e["kind"] == "print"]
    assert recorded == _expected(3)

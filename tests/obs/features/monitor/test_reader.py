"""The monitor's files read back: damaged, cut and foreign files, msprobe's own CSV files, the CLI's exit codes."""

from __future__ import annotations

import pytest

from obs._core.errors import DamagedFileError, NotOurFileError
from obs.cli import main
from obs.features.monitor.explain import explain
from obs.features.monitor.reader import find_run, read_run


def _run(tmp_path, files, name="Nov29_10-00-00-rank3-0a1b2c3d"):
    folder = tmp_path / "out" / name
    folder.mkdir(parents=True)
    for file, text in files.items():
        (folder / file).write_text(text)
    return folder


def _rows(n, spike_at=None, name="fc.weight"):
    return "".join(f"0,{name},{s},{5.0 if s == spike_at else 1.0 + 0.01 * (s % 3)},\"[2, 2]\",torch.float32\n"
                   for s in range(n))


HEADER = "vpp_stage,name,step,norm,shape,dtype\n"


def test_a_root_of_runs_reads_the_newest_and_its_rank_from_the_name(tmp_path):
    folder = _run(tmp_path, {"grad_reduced_0-99.csv": HEADER + _rows(40, spike_at=30)})
    found, others = find_run(str(tmp_path / "out"))
    assert found == str(folder) and others == []
    run = read_run(found)
    assert run.rank == 3 and run.meta == {} and run.steps == list(range(40))
    first = explain(run).first
    assert (first.step, first.kind, first.stage, first.name, first.stat) == (30, "wg", "backward", "fc.weight",
                                                                              "norm")


def test_msprobes_own_files_are_read(tmp_path):
    """msprobe's unreduced gradients and its activation file (micro_step column) read as they are."""
    actv = "vpp_stage,name,step,micro_step,norm,max,shape,dtype\n" + "".join(
        f"0,fc.input,{s},0,{1.0 + s % 2 * 0.01},2.0,\"[4, 2]\",torch.float32\n" for s in range(5))
    folder = _run(tmp_path, {"grad_unreduced_0-4.csv": HEADER + _rows(5), "actv_0-4.csv": actv})
    run = read_run(str(folder))
    kinds = {(s.prefix, s.kind, s.stage, s.micro) for s in run.series}
    assert kinds == {("grad_unreduced", "wg", "backward", None), ("actv", "xy", "forward", 0)}


def test_a_cut_last_line_is_left_out_and_said(tmp_path):
    folder = _run(tmp_path, {"grad_reduced_0-99.csv": HEADER + _rows(3) + "0,fc.weight,3,1.0"})
    run = read_run(str(folder))
    assert run.steps == [0, 1, 2] and "last line is cut" in run.problems[0]


def test_damaged_and_foreign_files_are_clear_errors(tmp_path, capsys):
    folder = _run(tmp_path, {"grad_reduced_0-99.csv": HEADER + _rows(2) + "0,fc.weight,2,lots,[],x\n"})
    with pytest.raises(DamagedFileError, match=r"grad_reduced_0-99.csv:4: column 'norm' must be a number"):
        read_run(str(folder))
    assert main(["monitor", "explain", str(folder)]) == 1
    assert "must be a number" in capsys.readouterr().err
    other = _run(tmp_path, {"grad_reduced_0-99.csv": "a,b,c\n1,2,3\n"}, name="x")
    with pytest.raises(NotOurFileError, match="not a monitor CSV file"):
        read_run(str(other))
    assert main(["monitor", "show", str(tmp_path / "empty")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["monitor", "show", str(tmp_path / "empty")]) == 2
    assert "no monitor run under" in capsys.readouterr().err


def test_no_anomaly_exits_0(tmp_path, capsys):
    folder = _run(tmp_path, {"grad_reduced_0-99.csv": HEADER + _rows(40)})
    assert main(["monitor", "explain", str(folder)]) == 0
    assert "no anomaly" in capsys.readouterr().out

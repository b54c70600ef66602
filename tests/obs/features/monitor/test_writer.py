"""The worker thread: CSV rows, the rules, and the sinks every other output hangs on (no torch: values as lists)."""

from __future__ import annotations

import io

from obs._core.internal import internal_error_counts, set_raise_internal_errors
from obs.features.monitor.detect import Detector, rules_from
from obs.features.monitor.writer import Block, Packet, StepValues, Worker

ROWS = (("fc.weight", None, "[4, 4]", "torch.float32"), ("fc.bias", None, "[4]", "torch.float32"))


def _packet(step: int, grad: float) -> Packet:
    blocks = [Block("_gnorm", ROWS, ("norm",)), Block("_unorm", ROWS, ("norm",)), Block("_wnorm", ROWS, ("norm",))]
    return Packet(step, blocks, [[grad, 1.0, 0.01, 0.01, 1.0, 2.0]])


def _eight_steps(tmp_path, sinks):
    """Eight steps through a worker with these sinks, a gradient spike at step 6, everything written and judged."""
    worker = Worker(str(tmp_path), detector=Detector(rules_from(10, 3, 5.0, {})), ndigits=6, per_file=100,
                    stream=io.StringIO(), sinks=sinks)
    try:
        for step in range(8):
            worker.submit(_packet(step, 1e4 if step == 6 else 1.0))
        assert worker.flush(10)
    finally:
        worker.close()


def test_sinks_get_every_judged_step_and_a_failing_sink_stops_nothing(tmp_path):
    got: list[StepValues] = []

    def broken(values: StepValues) -> None:
        raise RuntimeError("a sink's own bug")

    old = set_raise_internal_errors(False)  # as in production: reported and counted, not raised
    before = internal_error_counts().get("monitor sink broken", 0)
    try:
        _eight_steps(tmp_path, [broken, got.append])  # a spike at step 6
    finally:
        set_raise_internal_errors(old)
    assert internal_error_counts().get("monitor sink broken", 0) - before == 8
    assert [s.step for s in got] == list(range(8))
    values = {(p, n, stat): v for p, n, _, stat, v in got[0].values}
    assert values[("grad_reduced", "fc.weight", "norm")] == 1.0
    assert values[("update_ratio", "fc.bias", "ratio")] == 0.01 / 2.0
    assert values[("scalars", "grad_norm", "value")] == 2 ** 0.5
    assert [(a.prefix, a.name) for a in got[6].anomalies][:1] == [("grad_reduced", "fc.weight")]
    assert not got[5].anomalies
    assert (tmp_path / "grad_reduced_0-99.csv").read_text().count("\n") == 1 + 2 * 8  # the CSV files went on


def test_values_are_gathered_only_while_a_sink_wants_them(tmp_path):
    """A sink whose wants_values() says no (the recorder off, the metrics off) gets the anomalies, no values."""
    got: list[StepValues] = []

    class AnomaliesOnly:
        def wants_values(self) -> bool:
            return False

        def __call__(self, values: StepValues) -> None:
            got.append(values)

    _eight_steps(tmp_path, [AnomaliesOnly()])
    assert [s.step for s in got] == list(range(8)) and not any(s.values for s in got)
    assert [(a.prefix, a.name) for a in got[6].anomalies][:1] == [("grad_reduced", "fc.weight")]


def test_csv_rows_exactly_across_files_with_hostile_names_ids_and_non_finite_values(tmp_path):
    """The compiled step plan's rows, as msprobe's pandas writes them: quoted names, braces kept, ``id`` written but
    not judged, nan/inf spelt out; a file per ``per_file`` steps, each with its header once; a loss from
    ``obs.scalar`` replaces backward's from then on."""
    rows = (('a,"b"{0}', None, "[2]", "torch.float32"), ("c}", None, "[1]", "torch.bfloat16"))
    acts = (("blk", 0, "[3]", "torch.float32"),)
    worker = Worker(str(tmp_path), detector=Detector(rules_from(10, 3, 5.0, {})), ndigits=4, per_file=3,
                    stream=io.StringIO())
    try:
        for step in range(5):
            blocks = [Block("_gnorm", rows, ("norm",)), Block("actv", acts, ("norm", "id")),
                      Block("_unorm", rows, ("norm",), scales=(2.0, 1.0)), Block("_wnorm", rows, ("norm",)),
                      Block("_loss", (("loss", None, "", ""),), ("value",))]
            g = float("nan") if step == 4 else 3.0
            worker.submit(Packet(step, blocks, [[g, 4.0, 1.5, 140234567891.0], [0.5, 0.25, 2.0, 0.0, 0.75]]))
            if step == 3:
                worker.submit(("loss", step, 0.125))
        assert worker.flush(10)
    finally:
        worker.close()
    assert (tmp_path / "grad_reduced_0-2.csv").read_text() == (
        "vpp_stage,name,step,norm,shape,dtype\n" + "".join(
            f'0,"a,""b""{{0}}",{s},3,[2],torch.float32\n0,c}},{s},4,[1],torch.bfloat16\n' for s in range(3)))
    assert (tmp_path / "grad_reduced_3-5.csv").read_text() == (
        "vpp_stage,name,step,norm,shape,dtype\n"
        '0,"a,""b""{0}",3,3,[2],torch.float32\n0,c},3,4,[1],torch.bfloat16\n'
        '0,"a,""b""{0}",4,nan,[2],torch.float32\n0,c},4,4,[1],torch.bfloat16\n')
    assert (tmp_path / "actv_0-2.csv").read_text().splitlines()[:2] == [
        "vpp_stage,name,step,micro_step,norm,id,shape,dtype", "0,blk,0,0,1.5,1.402e+11,[3],torch.float32"]
    assert (tmp_path / "param_update_0-2.csv").read_text().splitlines()[1:3] == [
        '0,"a,""b""{0}",0,1,[2],torch.float32', "0,c},0,0.25,[1],torch.bfloat16"]
    assert (tmp_path / "update_ratio_0-2.csv").read_text().splitlines()[1:3] == [
        '0,"a,""b""{0}",0,0.25', "0,c},0,nan"]  # a weight at zero: no ratio
    scalars = (tmp_path / "scalars_3-5.csv").read_text().splitlines()
    assert scalars == ["vpp_stage,name,step,value", "0,grad_norm,3,5", "0,loss,3,0.75", "0,loss,3,0.125",
                       "0,grad_norm,4,nan"]
    assert not any(a.stat == "id" for a in worker.anomalies)
    assert [(a.step, a.name) for a in worker.anomalies if a.prefix == "grad_reduced"] == [(4, 'a,"b"{0}')]

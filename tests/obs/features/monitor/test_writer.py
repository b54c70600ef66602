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


def test_sinks_get_every_judged_step_and_a_failing_sink_stops_nothing(tmp_path):
    got: list[StepValues] = []

    def broken(values: StepValues) -> None:
        raise RuntimeError("a sink's own bug")

    old = set_raise_internal_errors(False)  # as in production: reported and counted, not raised
    before = internal_error_counts().get("monitor sink broken", 0)
    worker = Worker(str(tmp_path), detector=Detector(rules_from(10, 3, 5.0, {})), ndigits=6, per_file=100,
                    stream=io.StringIO(), sinks=[broken, got.append])
    try:
        for step in range(8):
            worker.submit(_packet(step, 1e4 if step == 6 else 1.0))
        assert worker.flush(10)
    finally:
        worker.close()
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

    worker = Worker(str(tmp_path), detector=Detector(rules_from(10, 3, 5.0, {})), ndigits=6, per_file=100,
                    stream=io.StringIO(), sinks=[AnomaliesOnly()])
    try:
        for step in range(8):
            worker.submit(_packet(step, 1e4 if step == 6 else 1.0))
        assert worker.flush(10)
    finally:
        worker.close()
    assert [s.step for s in got] == list(range(8)) and not any(s.values for s in got)
    assert [(a.prefix, a.name) for a in got[6].anomalies][:1] == [("grad_reduced", "fc.weight")]

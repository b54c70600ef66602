"""`format: tensorboard`: the monitor's values in a TensorBoard event file, in msprobe's tags, read back as TensorBoard
reads it (TFRecord frames of ``Event`` protos, checked by their CRCs); the anomaly counts; the error that names the
extra when tensorboardX is missing.  Small MLPs, a few steps, in-process."""

from __future__ import annotations

import json
import logging
import os
import struct
import sys

import pytest

import obs
from obs._core.errors import ObsConfigError
from obs.features.monitor.feature import feature
from obs.features.monitor.reader import read_run
from obs.features.monitor.tensorboard import INSTALL, TensorBoardSink, require_writer, tag_of
from obs.features.monitor.writer import Anomaly, StepValues
from tests.obs.features.monitor.test_feature import _train

pytest.importorskip("tensorboardX")


def _crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``folder``: tag -> [(step, value)]."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    names = sorted(n for n in os.listdir(folder) if n.startswith("events.out.tfevents."))
    assert names, os.listdir(folder)
    for name in names:
        with open(os.path.join(folder, name), "rb") as fh:
            data, at = fh.read(), 0
        while at < len(data):
            (length,), head = struct.unpack("<Q", data[at:at + 8]), data[at:at + 8]
            assert struct.unpack("<I", data[at + 8:at + 12])[0] == _crc(head)
            body = data[at + 12:at + 12 + length]
            assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == _crc(body)
            at += 16 + length
            event = Event.FromString(body)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_the_event_file_holds_every_series_in_msprobes_tags(tmp_path):
    """Each CSV value is a scalar of the event file, at its step, under msprobe's tag."""
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"),
                                              "format": "tensorboard"}}))
    obs.set_context(env_config_path=str(config))
    _train(4)
    assert feature.monitor.flush()
    folder = feature.monitor.folder
    run = read_run(folder)
    obs.reset_context()  # the run ends: its event file is flushed and closed
    scalars = read_scalars(folder)
    assert len(run.series) == len(scalars)
    for series in run.series:
        tag = tag_of(series.prefix, series.name, series.micro, series.stat, None)
        assert tag in scalars, sorted(scalars)
        got = scalars[tag]
        assert [s for s, _ in got] == list(series.steps)
        assert [v for _, v in got] == pytest.approx(series.values, rel=1e-5)  # float32 vs 6 significant digits
    assert {"0:0.weight/post_grad_norm", "0:0.weight/param_update_norm", "0:2.bias/update_ratio_ratio", "loss",
            "grad_norm"} <= set(scalars)
    try:  # TensorBoard's own reader, where it is installed (not a test dependency: it is large)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return
    accumulator = EventAccumulator(folder)
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == set(scalars)
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == scalars["loss"]


def test_anomaly_counts_and_the_rank_in_a_job(tmp_path):
    sink = TensorBoardSink(str(tmp_path), rank=1, world_size=2)
    spike = Anomaly(7, "update_ratio", "fc.weight", None, "ratio", 0.5, 0.01, "robust", 40.0)
    loss = Anomaly(7, "scalars", "loss", None, "value", 9.0, 2.0, "robust", 12.0)
    sink(StepValues(6, [("update_ratio", "fc.weight", None, "ratio", 0.01), ("actv", "fc.input", 2, "norm", 3.0)], []))
    sink(StepValues(7, [("update_ratio", "fc.weight", None, "ratio", 0.5)], [spike, loss]))
    sink(StepValues(8, [("update_ratio", "fc.weight", None, "ratio", 0.02)], [spike]))
    sink.close()
    scalars = read_scalars(tmp_path)
    assert scalars["0:fc.weight/rank1/update_ratio_ratio"] == [(6, pytest.approx(0.01)), (7, 0.5),
                                                               (8, pytest.approx(0.02))]
    assert scalars["0:fc.input.call2/rank1/actv_norm"] == [(6, 3.0)]
    assert scalars["anomalies/ur/rank1"] == [(7, 1.0), (8, 2.0)] and scalars["anomalies/loss/rank1"] == [(7, 1.0)]


def test_without_the_extra_the_error_names_it_and_the_csv_files_are_still_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
    with pytest.raises(ObsConfigError) as error:
        require_writer()
    assert "'tensorboard' extra" in str(error.value) and INSTALL in str(error.value)
    assert INSTALL == "pip install 'obs-runtime[tensorboard]'"
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"),
                                              "format": "tensorboard"}}))
    caplog.set_level(logging.ERROR, logger="obs")
    obs.set_context(env_config_path=str(config))
    _train(2)
    assert feature.monitor.flush()
    assert INSTALL in caplog.text and "the CSV files are written without it" in caplog.text
    assert read_run(feature.monitor.folder).steps == [0, 1]
    assert not [n for n in os.listdir(feature.monitor.folder) if n.startswith("events.")]

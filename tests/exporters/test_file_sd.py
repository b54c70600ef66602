"""A rank's Prometheus file-SD entry: the format Prometheus reads, written only when it changes, replaced atomically
(no temporary name a ``*.json`` glob could see), removed when the rank ends.  Prometheus reading the folder of a
real job: tests/exporters/test_prometheus.py."""

from __future__ import annotations

import json
import os
import pathlib
import stat

from exporters.file_sd import FOLDER, TargetFile, target_address


def test_the_entry_has_the_target_and_the_labels_and_is_rewritten_only_on_a_change(tmp_path):
    folder = tmp_path / FOLDER
    target = TargetFile(str(folder), pid=4242, node="node7")
    assert target.path == str(folder / "node7_4242.json")
    assert target.write("node7:9465", run_id="r1", rank=9, local_rank=1)
    assert json.loads(pathlib.Path(target.path).read_text()) == [
        {"targets": ["node7:9465"], "labels": {"run_id": "r1", "rank": "9", "local_rank": "1", "node": "node7"}}]
    assert not target.write("node7:9465", run_id="r1", rank=9, local_rank=1)  # unchanged: not written again
    assert target.write("node7:9465", run_id="agreed", rank=3, local_rank=1)  # the rank learnt its identity
    assert json.loads(pathlib.Path(target.path).read_text())[0]["labels"]["rank"] == "3"
    assert os.listdir(folder) == ["node7_4242.json"]  # no temporary file left
    assert stat.S_IMODE(os.stat(target.path).st_mode) == 0o600
    target.remove()
    assert os.listdir(folder) == []
    target.remove()  # twice: nothing to do


def test_an_endpoint_on_every_interface_is_announced_by_the_node_name():
    assert target_address("0.0.0.0", 9464, "node7") == "node7:9464"
    assert target_address("", 9464, "node7") == "node7:9464"
    assert target_address("127.0.0.1", 9465, "node7") == "127.0.0.1:9465"
    assert target_address("fe80::1", 9464, "node7") == "[fe80::1]:9464"


def test_a_node_name_is_made_safe_for_a_file_name(tmp_path):
    target = TargetFile(str(tmp_path), pid=1, node="../evil/name")
    assert os.path.dirname(target.path) == str(tmp_path) and "/" not in os.path.basename(target.path)


def test_the_exporter_announces_its_endpoint_rewrites_it_with_the_agreed_identity_and_removes_it_at_its_end(tmp_path):
    from exporters.sidecar import ExportConfig, Exporter
    from recorder.layout import Kind
    from recorder.ring import RingWriter
    from tests.recorder._jobs import free_port

    ring = str(tmp_path / "p.obsring")
    writer = RingWriter(ring, {"step": 64, "module": 16, "op": 16, "memory": 16, "collective": 16, "blob": 16},
                        pid=os.getpid(), rank=0, world_size=1, meta={"run_id": "proposed", "host": "h"})
    port, folder = free_port(), tmp_path / FOLDER
    exporter = Exporter(ExportConfig(ring=ring, folder=str(tmp_path / "rank_0"), metrics=("prometheus",),
                                     prometheus_host="127.0.0.1", prometheus_port=port, targets=str(folder),
                                     trainer_pid=os.getpid(), keep_ring=True))
    try:
        exporter.step()
        (path,) = folder.glob("*.json")
        assert json.loads(path.read_text())[0]["targets"] == [f"127.0.0.1:{port}"]
        assert json.loads(path.read_text())[0]["labels"]["run_id"] == "proposed"
        writer.blob(Kind.MARKER, {"marker": "identity", "run_id": "agreed", "rank": 5, "world_size": 8})
        exporter.step()
        labels = json.loads(path.read_text())[0]["labels"]
        assert (labels["run_id"], labels["rank"]) == ("agreed", "5")
    finally:
        exporter.close()
        writer.close(remove=True)
    assert list(folder.glob("*.json")) == []

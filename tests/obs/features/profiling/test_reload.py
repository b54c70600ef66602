"""A hot reload that restarts the profiler (a new level): the exporter of the session before ends before the new one
writes, every step is in the trace once, and each session's status is kept."""

from __future__ import annotations

import json

import obs
from obs import profiling
from tests.training import train


def test_a_reload_that_restarts_the_profiler_loses_no_step_and_keeps_both_sessions_files(tmp_path):
    from exporters.trace_reader import read_folder
    from obs.features.env_config import feature as env_feature

    config, out = tmp_path / "obs.json", tmp_path / "prof"
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(out)}}))
    obs.set_context(env_config_path=str(config))
    first = profiling.session()
    train(4)
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(out),
                                               "options": "training_trace:task_trace"}}))
    assert env_feature.wait_staged(lambda cfg: cfg.values["profiler"]["options"] != "training_trace", 10) is not None
    train(4)
    second = profiling.session()
    assert second is not None and second is not first
    obs.reset_context()
    folder = read_folder(str(out / "rank_0"))
    spans = [s for f in folder.files for s in f.spans]
    steps = sorted(s.attributes["ml.step"] for s in spans if s.kind == "step")
    assert steps == list(range(1, 9))
    step_of = {s.trace_id: s.attributes["ml.step"] for s in spans if s.kind == "step"}
    assert {step_of[s.trace_id] for s in spans if s.kind == "module"} == {5, 6, 7, 8}
    # one writer at a time: the first session's files were whole (closed) when the second's exporter rotated them
    assert json.loads((out / "rank_0" / "trace.1.json").read_text())
    (status,) = folder.statuses  # one file per trainer process: the later exporter keeps the earlier's status
    assert status["steps"] == 4 and [s["steps"] for s in status["previous"]] == [4]
    mine = profiling.feature.statuses[-2:]
    assert [s["ring"] for s in mine] == [first.ring_path, second.ring_path] and [s["steps"] for s in mine] == [4, 4]

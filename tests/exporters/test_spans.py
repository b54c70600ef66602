"""Span building from one step's timings: tree, ids, the budget and what is aggregated instead of dropped."""

from __future__ import annotations

import pytest

from exporters.spans import ModuleCall, OpCall, Phase, StepRecord, build_spans, trace_id
from exporters.step_filter import StepSelection, parse_steps

MS = 1_000_000


def record(step: int = 7) -> StepRecord:
    r = StepRecord(step, 0, 10 * MS)
    r.phases = [Phase("data", -MS, 0), Phase("forward", 0, 2 * MS), Phase("forward", 2 * MS, 3 * MS),
                Phase("backward", 3 * MS, 8 * MS), Phase("optimizer", 8 * MS, 9 * MS)]
    r.modules = [ModuleCall("Default/net-Net", 0, 2 * MS), ModuleCall("Default/net-Net/fc1-Linear", 0, MS),
                 ModuleCall("Default/net-Net/blk-Block", MS, 2 * MS),
                 ModuleCall("Default/net-Net/blk-Block/inner-Linear", MS, MS + MS // 2),
                 ModuleCall("Default/net-Net/blk-Block/inner-Linear/deep-Thing", MS, MS + 1000),
                 ModuleCall("Default/net-MSELoss", 2 * MS, 3 * MS)]
    r.ops = [OpCall("addmm", "Default/net-Net/fc1-Linear", 100, 900_000),
             OpCall("relu", "Default/net-Net/blk-Block", MS + 600_000, MS + 700_000),
             OpCall("mm", "", 4 * MS, 6 * MS), OpCall("mm", "", 6 * MS, 7 * MS),
             OpCall("add_", "", 8 * MS, 8 * MS + 10)]
    return r


def by_name(spans):
    return {s.name: s for s in spans}


def test_training_trace_is_a_step_with_its_phases_and_consecutive_forwards_merged():
    spans = build_spans(record(), run_id="run1", rank=3, world_size=4, levels=("training_trace",))
    assert [s.name for s in spans] == ["step", "data", "forward", "backward", "optimizer"]
    step = spans[0]
    assert step.parent_id == 0 and all(s.parent_id == step.span_id for s in spans[1:])
    assert step.attributes == {"ml.step": 7, "ml.rank": 3, "ml.world_size": 4, "ml.run_id": "run1"}
    assert (step.start_ns, step.end_ns) == (-MS, 10 * MS)  # the data wait belongs to the step
    assert (by_name(spans)["forward"].start_ns, by_name(spans)["forward"].end_ns) == (0, 3 * MS)
    assert len({s.span_id for s in spans}) == len(spans)


def test_one_trace_per_step_shared_by_every_rank():
    a = build_spans(record(), run_id="run1", rank=0, world_size=2, levels=("training_trace",))
    b = build_spans(record(), run_id="run1", rank=1, world_size=2, levels=("training_trace",))
    assert {s.trace_id for s in a} == {s.trace_id for s in b} == {trace_id("run1", 7)}
    assert not {s.span_id for s in a} & {s.span_id for s in b}
    assert trace_id("run1", 8) != trace_id("run1", 7) != trace_id("run2", 7)


def test_task_trace_nests_modules_under_forward_down_to_the_depth():
    spans = build_spans(record(), run_id="r", rank=0, world_size=1, levels=("training_trace", "task_trace"),
                        module_depth=2)
    named = by_name(spans)
    assert "deep-Thing" not in named and "inner-Linear" not in named  # depth 3 and 4
    assert named["net-Net"].parent_id == named["forward"].span_id
    assert named["fc1-Linear"].parent_id == named["net-Net"].span_id
    assert named["net-MSELoss"].parent_id == named["forward"].span_id
    assert named["fc1-Linear"].attributes["ml.module.scope"] == "Default/net-Net/fc1-Linear"
    # what was cut by depth is aggregated into the span that holds it, and counted on the step
    assert named["blk-Block"].attributes["obs.aggregated.modules"] == 2
    assert named["step"].attributes["obs.spans.aggregated"] == 2


def test_op_trace_keeps_the_longest_ops_and_aggregates_the_rest_into_their_parent():
    spans = build_spans(record(), run_id="r", rank=0, world_size=1, levels=("training_trace", "op_trace"), budget=7)
    assert len(spans) == 7
    ops = [s for s in spans if s.kind == "op"]
    assert sorted(s.end_ns - s.start_ns for s in ops) == [MS, 2 * MS]  # the two longest
    named = by_name(spans)
    assert all(s.parent_id == named["backward"].span_id for s in ops)
    fwd = named["forward"].attributes
    assert fwd["ml.ops.names"] == ["addmm", "relu"] and fwd["ml.ops.counts"] == [1, 1]
    assert fwd["ml.ops.total_ns"] == [899_900, 100_000]
    assert named["optimizer"].attributes["ml.ops.names"] == ["add_"]
    assert named["step"].attributes["obs.spans.aggregated"] == 3


@pytest.mark.parametrize("budget", [5, 6, 9, 50])
def test_the_budget_is_never_exceeded_and_nothing_is_lost(budget):
    r = record()
    spans = build_spans(r, run_id="r", rank=0, world_size=1, levels=("training_trace", "task_trace", "op_trace"),
                        budget=budget, module_depth=9)
    assert len(spans) <= budget
    shown = sum(s.kind in ("module", "op") for s in spans)
    assert shown + spans[0].attributes.get("obs.spans.aggregated", 0) == len(r.modules) + len(r.ops)
    ids = {s.span_id for s in spans}
    assert all(s.parent_id in ids for s in spans[1:])


def test_an_incomplete_step_says_so():
    r = record()
    r.complete = False
    assert build_spans(r, run_id="r", rank=0, world_size=1, levels=("training_trace",))[0].attributes[
        "ml.step.incomplete"] is True


def test_step_selection():
    assert parse_steps("") == StepSelection()
    sel = parse_steps("0-3|7|10-")
    assert [s for s in range(15) if sel.selected(s)] == [0, 1, 2, 3, 7, 10, 11, 12, 13, 14]
    assert [s for s in range(1, 10) if parse_steps(3).selected(s)] == [3, 6, 9]
    for bad in ("x", "5-2", "1||2", 0, True, 1.5):
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_phases_beyond_the_budget_are_aggregated_on_the_step():
    r = StepRecord(1, 0, 100 * MS)
    r.phases = [Phase("forward" if i % 2 == 0 else "backward", i * MS, (i + 1) * MS) for i in range(40)]  # accumulation
    spans = build_spans(r, run_id="r", rank=0, world_size=1, levels=("training_trace",), budget=10)
    assert len(spans) == 10
    step = spans[0].attributes
    assert step["obs.spans.aggregated"] == 31
    assert dict(zip(step["ml.phases.names"], step["ml.phases.counts"])) == {"backward": 16, "forward": 15}
    assert sum(step["ml.phases.total_ns"]) == 31 * MS

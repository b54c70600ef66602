"""Phases of ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization): the closure's forward and
backward are forward and backward, the optimizer phase is the step's time outside its closure calls, and a step's
phases never overlap, so their shares add up to the step (profiler summary, the recorder's bundle)."""

from __future__ import annotations

import itertools
import json
import os
import time
import traceback

import pytest
import torch
import torch.nn.functional as F

import obs
from obs import profiling
from obs.runtime.steps import tracker
from recorder.arrival import timeline_from_events
from recorder.bundle_reader import load_bundle


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _lbfgs(max_iter):
    """An LBFGS optimizer of a tiny model and its closure (LBFGS calls it up to ``max_iter`` times a step)."""
    model, (x, y) = _model(), _data()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=max_iter)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss
    return opt, closure


class Recorded:
    """PHASE events as (step, name, begin, end), and the closure calls' (entry, exit), in perf_counter ns."""

    def __init__(self):
        self.phases, self.calls = [], []
        obs.subscribe(obs.Event.PHASE, lambda name, begin, end: self.phases.append((tracker.step, name, begin, end)))

    def closure_of(self, body):
        def closure():
            entered = time.perf_counter_ns()
            try:
                return body()
            finally:
                self.calls.append((tracker.step, entered, time.perf_counter_ns()))
        return closure

    def names(self, step):
        return [name for s, name, _, _ in sorted(self.phases, key=lambda p: p[2]) if s == step]


def _no_overlap(phases):
    ordered = sorted(phases, key=lambda p: p[2])
    return all(a[3] <= b[2] for a, b in itertools.pairwise(ordered))


def _inside(phase, calls):
    return any(entered <= phase[2] and phase[3] <= left for _, entered, left in calls)


def test_lbfgs_each_closure_call_is_forward_and_backward_and_the_optimizer_is_the_rest():
    rec = Recorded()
    opt, body = _lbfgs(4)
    closure = rec.closure_of(body)
    for _ in range(2):
        with obs.step():
            opt.step(closure)
    for step in (1, 2):
        calls = [c for c in rec.calls if c[0] == step]
        names = rec.names(step)
        assert len(calls) > 1  # LBFGS evaluated the closure more than once
        assert names.count("forward") == names.count("backward") == len(calls)
        assert names[0] == names[-1] == "optimizer" and names.count("optimizer") <= len(calls) + 1
    assert _no_overlap(rec.phases)
    for phase in rec.phases:
        assert _inside(phase, rec.calls) == (phase[1] != "optimizer"), phase


def test_a_hand_written_closure_passed_by_keyword_as_lightning_does():
    rec = Recorded()
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def training_step():  # Lightning's closure: training_step, zero_grad, backward, the loss returned
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        return loss

    closure = rec.closure_of(training_step)
    for _ in range(3):
        with obs.step():
            opt.step(closure=closure)
    for step in (1, 2, 3):
        assert rec.names(step) == ["optimizer", "forward", "backward", "optimizer"]
    assert _no_overlap(rec.phases)


def test_a_step_without_a_closure_keeps_one_optimizer_phase_and_never_wraps(monkeypatch):
    from obs.runtime.torch import _phases

    def refuse(*args, **kwargs):
        raise AssertionError("a closure-less step took the closure path")

    monkeypatch.setattr(_phases, "_with_closure", refuse)
    rec = Recorded()
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with obs.step():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert rec.names(1) == rec.names(2) == ["forward", "backward", "optimizer"]


def test_an_error_in_the_closure_reaches_the_user_without_an_obs_frame():
    Recorded()
    model, (x, _) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        model(x)
        raise ValueError("boom in the closure")

    with pytest.raises(ValueError, match="boom in the closure") as info:
        opt.step(closure)
    files = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
    assert not any(f.endswith(os.path.join("obs", "runtime", "torch", "_phases.py")) for f in files), files


def test_the_profiler_summary_shares_add_up_to_the_step_with_lbfgs(tmp_path):
    obs.set_context(enable_profiling=True, profiling_options=json.dumps({"output": str(tmp_path / "prof")}))
    opt, closure = _lbfgs(3)
    for _ in obs.steps(range(4)):
        opt.step(closure)
    obs.reset_context()
    summary = profiling.last_status()["summary"]
    shares = {p["name"]: p["share"] for p in summary["phases"]}
    assert set(shares) == {"data", "forward", "backward", "optimizer"}
    assert sum(shares.values()) <= 1.0 + 1e-3, shares  # each share is rounded to 4 places
    counts = {p["name"]: p["count"] for p in summary["phases"]}
    assert counts["forward"] == counts["backward"] >= 2 * 4  # every closure call's forward and backward


def test_the_recorders_phases_of_a_closure_step_do_not_overlap(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
    obs.set_context(env_config_path=str(config))
    opt, closure = _lbfgs(3)
    for _ in range(3):
        opt.step(closure)
    bundle = load_bundle(obs.rdr.dump("checkpoint"))
    timeline = timeline_from_events(0, "h", bundle.iter_events("steps.jsonl"))
    for step in (1, 2, 3):
        phases = sorted((p for p in timeline.phases if p.step == step), key=lambda p: p.begin)
        assert [p.name for p in phases].count("forward") >= 2
        assert all(a.end <= b.begin for a, b in itertools.pairwise(phases))
        inside = sum(p.end - p.begin for p in phases)
        first, last = phases[0].begin, phases[-1].end
        assert inside <= last - first  # the phases' sum fits in the time they span: none counted twice

"""Device time from the ring to the spans and the trace files: DEVICE_TIME and MEMORY_PEAK slots (written by the
real ring writer, by hand) joined to their steps, phases and modules; steps held until their device times come,
bounded; the GPU tracks of trace.json."""

from __future__ import annotations

import json
import os
import time

from exporters.follow import RingFollower, StepAssembler
from exporters.spans import build_spans
from recorder.layout import STEP_TIMED, DeviceTarget, Kind
from recorder.ring import RingWriter

CAP = {"step": 64, "module": 64, "op": 16, "memory": 16, "collective": 16, "device": 64, "blob": 16}
LEVELS = ("training_trace", "task_trace", "op_trace")
SCOPE = "Default/net-Net"


class Trainer:
    """Writes a profile ring as the profiler does on CUDA, and returns the seq each slot got."""

    def __init__(self, tmp_path) -> None:
        self.w = RingWriter(os.path.join(tmp_path, "p.obsring"), dict(CAP), pid=os.getpid(), rank=0, world_size=1,
                            meta={"run_id": "r"})
        self.device = self.w.appender("device")

    def slot(self, ring: str, kind: int, flags: int, a: int, b: int, c: int, d: int) -> int:
        pack, mm, base, cap, size, counter, seq, clock = self.w.slots(ring)
        idx, number = next(counter), next(seq)
        pack(mm, base + (idx % cap) * size, number, idx + 1, clock(), kind, flags, a, b, c, d)
        return number

    def step(self, n: int, *, timed: bool = True) -> dict[str, int]:
        """One step: a root module call in forward, then backward; the seqs of its module and phases."""
        sid = self.w.intern(SCOPE)
        self.slot("step", Kind.STEP_BEGIN, STEP_TIMED if timed else 0, 0, n, 0, 0)
        module = self.slot("module", Kind.MODULE_ENTER, 0, sid, n, 0, 0)
        self.slot("module", Kind.MODULE_EXIT, 0, sid, n, 0, 0)
        forward = self.slot("step", Kind.PHASE, 0, 1, n, 0, 0)
        backward = self.slot("step", Kind.PHASE, 0, 2, n, 0, 0)
        self.slot("step", Kind.STEP_END, 0, 0, n, 1000, 0)
        return {"module": module, "forward": forward, "backward": backward, "scope": sid}

    def timed(self, n: int, seqs: dict[str, int], chain: int = -1) -> None:
        """The step's device times, as the poller writes them once the device ran the step."""
        self.device(Kind.DEVICE_TIME, DeviceTarget.MODULE, seqs["scope"], seqs["module"], 1_000, 4_000)
        self.device(Kind.DEVICE_TIME, DeviceTarget.PHASE, 1, seqs["forward"], 0, 6_000)
        self.device(Kind.DEVICE_TIME, DeviceTarget.PHASE, 2, seqs["backward"], 6_000, 3_000)
        self.device(Kind.DEVICE_TIME, DeviceTarget.COLLECTIVE, self.w.intern("all_reduce"), n, 7_000, 1_000)
        self.slot("memory", Kind.MEMORY_PEAK, 0, self.w.intern("cuda:0"), n, 5 << 20, 8 << 20)
        self.device(Kind.DEVICE_TIME, DeviceTarget.STEP, 0, n, chain, 9_500)


def feed(assembler: StepAssembler, follower: RingFollower) -> list:
    follower.poll()
    return assembler.feed(follower.poll())


def test_device_times_become_span_attributes_placed_after_the_step_reference(tmp_path):
    t = Trainer(str(tmp_path))
    f = RingFollower(t.w.path)
    a = StepAssembler(f)
    one = t.step(1)
    two = t.step(2)  # step 1 is finished now, its device times not written yet: it waits
    assert feed(a, f) == [] and a.device.held == 1
    t.timed(1, one)
    (first,) = feed(a, f)
    t.timed(2, two, chain=20_000)
    t.step(3, timed=False)
    (second, third) = feed(a, f) + a.drain()
    assert third.step == 3 and third.device is None and not third.device_missing

    assert first.device is not None and first.device.start_ns == first.start_ns  # nothing before it: the host's time
    assert first.device.duration_ns == 9_500
    assert second.device is not None  # the device ran step 2's reference 20 µs after step 1's, or after the host
    assert second.device.start_ns == max(second.start_ns, first.device.start_ns + 20_000)
    spans = build_spans(first, run_id="r", rank=0, world_size=1, levels=LEVELS)
    by_name = {s.name: s for s in spans}
    g = first.device.start_ns
    assert by_name["step"].attributes["obs.device.time_ns"] == 9_500
    assert by_name["step"].attributes["obs.memory.peak_allocated_bytes"] == 5 << 20
    assert by_name["step"].attributes["obs.memory.peak_reserved_bytes"] == 8 << 20
    assert by_name["step"].attributes["obs.memory.device"] == "cuda:0"
    assert by_name["step"].attributes["obs.device.collectives_ns"] == 1_000
    assert (by_name["forward"].attributes["obs.device.start_ns"], by_name["forward"].attributes["obs.device.time_ns"]) \
        == (g, 6_000)
    assert by_name["backward"].attributes["obs.device.start_ns"] == g + 6_000
    assert (by_name["net-Net"].attributes["obs.device.start_ns"], by_name["net-Net"].attributes["obs.device.time_ns"]) \
        == (g + 1_000, 4_000)
    coll = by_name["all_reduce"]
    assert coll.kind == "collective" and (coll.start_ns, coll.end_ns) == (g + 7_000, g + 8_000)
    assert coll.parent_id == by_name["step"].span_id
    t.w.close(remove=True)
    f.close()


def test_a_step_whose_device_times_never_come_goes_without_them_and_says_so(tmp_path):
    t = Trainer(str(tmp_path))
    f = RingFollower(t.w.path)
    a = StepAssembler(f, device_wait_ns=1_000_000_000)
    one = t.step(1)
    two = t.step(2)
    assert feed(a, f) == []
    assert a.idle(a.last_t + 999_000_000) == []  # still within the wait
    (record,) = a.idle(a.last_t + 1_000_000_000)
    assert record.step == 1 and record.device_missing and record.device is None
    spans = build_spans(record, run_id="r", rank=0, world_size=1, levels=LEVELS)
    assert spans[0].attributes["obs.device.missing"] is True and "obs.device.time_ns" not in spans[0].attributes
    t.timed(1, one)  # too late: counted, not joined to a later step
    t.timed(2, two)
    t.step(3, timed=False)
    records = feed(a, f) + a.drain()
    assert [r.step for r in records] == [2, 3] and a.device.late == 5
    assert records[0].device is not None and records[0].memory["peak_reserved_bytes"] == 8 << 20
    t.w.close(remove=True)
    f.close()


def test_steps_of_a_kernel_capture_wait_for_its_kernels_and_get_kernel_spans(tmp_path):
    t = Trainer(str(tmp_path))
    f = RingFollower(t.w.path)
    a = StepAssembler(f)
    t.device(Kind.DEVICE_TIME, DeviceTarget.KERNELS_BEGIN, 0, 1, 1, 0)
    one = t.step(1)
    t.timed(1, one)
    t.step(2, timed=False)
    assert feed(a, f) == []  # step 1 has its device times, but its kernels are still being read
    gemm, relu = t.w.intern("sm90_xmma_gemm"), t.w.intern("vectorized_elementwise_kernel")
    t.device(Kind.DEVICE_TIME, DeviceTarget.KERNEL, gemm, 1, 1_700_000_000_000_000_000, 3_000)
    for i in range(5):
        t.device(Kind.DEVICE_TIME, DeviceTarget.KERNEL, relu, 1, 1_700_000_000_000_010_000 + i * 100, 50)
    t.device(Kind.DEVICE_TIME, DeviceTarget.KERNELS_END, 0, 1, 1, 6)
    (record,) = feed(a, f)
    kernels = [c for c in record.calls if c.kind == "kernel"]
    assert len(kernels) == 6 and kernels[0].start_ns == 1_700_000_000_000_000_000  # CUPTI's own wall-clock times
    spans = build_spans(record, run_id="r", rank=0, world_size=1, levels=LEVELS, budget=9)
    shown = [s.name for s in spans if s.kind == "kernel"]  # the room the module span leaves, the longest first
    assert shown == ["sm90_xmma_gemm"] + ["vectorized_elementwise_kernel"] * 3
    step = spans[0]
    assert step.attributes["obs.kernels.names"] == ["vectorized_elementwise_kernel"]
    assert step.attributes["obs.kernels.counts"] == [2] and step.attributes["obs.kernels.total_ns"] == [100]
    assert len(spans) == 9 and step.attributes["obs.spans.aggregated"] == 2
    assert [s.name for s in spans if s.kind == "module"] == ["net-Net"]
    assert [r.step for r in a.drain()] == [2]
    t.w.close(remove=True)
    f.close()


def test_the_exporter_writes_a_gpu_track_and_the_attributes_to_both_files(tmp_path):
    from exporters.sidecar import ExportConfig, Exporter
    from exporters.trace_reader import read_folder

    t = Trainer(str(tmp_path))
    exporter = Exporter(ExportConfig(ring=t.w.path, folder=str(tmp_path), levels=LEVELS, trainer_pid=os.getpid(),
                                     keep_ring=True))
    gemm = t.w.intern("sm90_xmma_gemm")
    t.device(Kind.DEVICE_TIME, DeviceTarget.KERNELS_BEGIN, 0, 1, 1, 0)
    t.timed(1, t.step(1))
    t.device(Kind.DEVICE_TIME, DeviceTarget.KERNEL, gemm, 1, time.time_ns(), 3_000)  # at its own (wall-clock) time
    t.device(Kind.DEVICE_TIME, DeviceTarget.KERNELS_END, 0, 1, 1, 1)
    t.timed(2, t.step(2), chain=10_000)
    exporter.step(final=True)
    exporter.close()
    events = json.loads((tmp_path / "trace.json").read_text())
    names = {(e["tid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert names == {(1, "training steps"), (2, "GPU (CUDA events)"), (3, "GPU kernels (CUPTI)")}
    gpu = [e for e in events if e.get("tid") == 2 and e.get("ph") == "X"]
    assert sorted({e["name"] for e in gpu}) == ["all_reduce", "backward", "forward", "net-Net", "step"]
    assert [e["dur"] for e in gpu if e["name"] == "step"] == [9.5, 9.5]
    steps = sorted((e for e in gpu if e["name"] == "step"), key=lambda e: float(e["ts"]))
    assert float(steps[1]["ts"]) - float(steps[0]["ts"]) >= 10.0  # laid end to end by the chain, at least
    for e in gpu:  # nested in their step on the track, as on the device
        step = max((s for s in steps if float(s["ts"]) <= float(e["ts"]) + 1e-9), key=lambda s: float(s["ts"]))
        assert float(e["ts"]) + float(e["dur"]) <= float(step["ts"]) + float(step["dur"]) + 1e-9
    (kernel,) = [e for e in events if e.get("tid") == 3 and e.get("ph") == "X"]
    assert kernel["name"] == "sm90_xmma_gemm" and kernel["cat"] == "kernel"
    otlp = (tmp_path / "traces.otlp.jsonl").read_text()
    assert "obs.device.time_ns" in otlp and "obs.memory.peak_reserved_bytes" in otlp
    read = [s for file in read_folder(str(tmp_path)).files for s in file.spans]  # obs trace reads it as before
    assert {s.kind for s in read} == {"step", "phase", "module", "other"}  # other: the collective, the kernel
    assert all("obs.device.start_ns" in s.attributes for s in read)
    t.w.close(remove=True)

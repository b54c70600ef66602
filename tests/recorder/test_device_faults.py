"""CUDA faults named from the exception and the ring: the kind (from PyTorch's real types and CUDA's real messages),
the ops launched before it with their modules, the module that raised, where it surfaced, and the advice."""

from __future__ import annotations

import json

import pytest
import torch

from obs._core.internal import internal_error_counts, set_raise_internal_errors
from recorder import device_faults
from recorder.device_faults import bundle_part, classify, classify_text, describe, explanation_text, fault_message
from recorder.layout import DEFAULT_CAPACITY, Kind
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring
from recorder.stacks import exception_record

# CUDA's and PyTorch's own wording (c10/cuda/CUDAException.cpp, the caching allocator)
ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some other "
          "API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
          "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
ILLEGAL = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported"
OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.05 GiB "
       "is free. Of the allocated memory 76.50 GiB is allocated by PyTorch, and 12.00 MiB is reserved by PyTorch but "
       "unallocated.")
SMALL = {**DEFAULT_CAPACITY, "module": 64, "op": 64, "step": 16, "blob": 16}
EMB, HEAD = "Default/net-Net/emb-Embedding", "Default/net-Net/head-Linear"


@pytest.mark.parametrize(("error", "kind"), [
    (torch.OutOfMemoryError(OOM), "cuda_oom"),
    (torch.cuda.OutOfMemoryError(OOM), "cuda_oom"),
    (RuntimeError(OOM), "cuda_oom"),  # an older torch raised a plain RuntimeError
    (torch.AcceleratorError(ASSERT), "device_assert"),
    (RuntimeError(ASSERT), "device_assert"),
    (torch.AcceleratorError(ILLEGAL), "illegal_memory_access"),
    (RuntimeError("CUDA error: misaligned address\n"), "cuda_error"),
    (RuntimeError("CUDA error: out of memory\n"), "cuda_oom"),  # cudaMalloc outside the caching allocator
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"), "cuda_error"),
    (torch.AcceleratorError("an error this module has never heard of"), "cuda_error"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)"), None),
    (ValueError("CUDA is fine"), None),
])
def test_the_kind_comes_from_the_type_and_the_message(error, kind):
    assert classify(error) == kind


def test_a_cuda_fault_a_user_re_raised_as_another_error_is_still_named():
    try:
        try:
            raise torch.AcceleratorError(ASSERT)
        except RuntimeError as exc:
            raise ValueError("the batch failed") from exc
    except ValueError as outer:
        assert classify(outer) == "device_assert"


def test_recorded_text_is_classified_too():
    assert classify_text(f"OutOfMemoryError: {OOM}") == "cuda_oom"
    assert classify_text(f"AcceleratorError: {ILLEGAL}") == "illegal_memory_access"
    assert classify_text("OutOfMemoryError: MPS backend out of memory") is None
    assert classify_text("ValueError: boom") is None


def ring(tmp_path, ops, *, modules=()):
    """A real ring (the recorder's writer): step 1, then ``modules`` entered, then ``ops`` as (name, scope, inputs,
    flags); its contents as a dump reads them."""
    writer = RingWriter(str(tmp_path / "r.obsring"), SMALL, pid=1, rank=0, world_size=1,
                        meta={"granularity": "op" if ops else "module"})
    writer.appender("step")(Kind.STEP_BEGIN, 0, 0, 1, 0, 0)
    for scope in modules:
        writer.appender("module")(Kind.MODULE_ENTER, 0, writer.intern(scope), 1, 0, 0)
    op = writer.appender("op")
    for name, scope, inputs, flags in ops:
        op(Kind.OP, flags, writer.intern(name), writer.intern(scope), 1000, writer.intern(inputs))
    contents = read_ring(bytes(writer.buffer()))
    writer.close(remove=True)
    return contents


OPS = [
    ("addmm", HEAD, "float32[4]@cuda:0 float32[8, 16]@cuda:0 float32[16, 4]@cuda:0", 2),
    ("linear", HEAD, "float32[8, 16]@cuda:0 float32[4, 16]@cuda:0 float32[4]@cuda:0", 0),
    ("_local_scalar_dense", "", "float32[]@cuda:0", 0),  # loss.item(): the device was waited for, and all was well
    ("index_select", EMB, "float32[100, 16]@cuda:0 int int64[8]@cuda:0", 2),
    ("embedding", EMB, "float32[100, 16]@cuda:0 int64[8]@cuda:0 int bool bool", 0),
    ("addmm", HEAD, "float32[4]@cuda:0 float32[8, 16]@cuda:0 float32[16, 4]@cuda:0", 2),
    ("linear", HEAD, "float32[8, 16]@cuda:0 float32[4, 16]@cuda:0 float32[4]@cuda:0", 0),
    ("_local_scalar_dense", "", "float32[]@cuda:0", 1),  # the next loss.item(): where the assert surfaced
]


def surfaced_at_item():
    def train_step():
        raise torch.AcceleratorError(ASSERT)  # as loss.item() raises it

    try:
        train_step()
    except torch.AcceleratorError as exc:
        return exc, exception_record(exc)
    raise AssertionError("no error")


def test_an_assert_names_the_ops_since_the_last_wait_with_their_modules(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    error, record = surfaced_at_item()
    out = describe(ring(tmp_path, OPS), "device_assert", message=str(error), exception=record)
    assert out["asynchronous"] is True and out["launch_blocking"] is False and out["title"] == "device-side assert"
    assert out["message"] == "CUDA error: device-side assert triggered"  # the first line: the rest is CUDA's advice
    assert [(o["name"], o["scope"], o["since_wait"]) for o in out["ops"]][-5:] == [
        ("index_select", EMB, True), ("embedding", EMB, True), ("addmm", HEAD, True), ("linear", HEAD, True),
        ("_local_scalar_dense", "", True)]
    assert out["ops_since_wait"] == 5 and [o["since_wait"] for o in out["ops"][:3]] == [False] * 3
    assert out["ops"][-1]["raised"] and out["ops"][3]["nested"] and out["ops"][-4]["device"] == "cuda"
    assert out["surfaced_at"]["function"] == "train_step" and "AcceleratorError" in out["surfaced_at"]["code"]
    advice = " ".join(out["advice"])
    assert "CUDA_LAUNCH_BLOCKING=1" in advice and "index out of range" in advice and "restart" in advice
    text = explanation_text(out)
    assert text.startswith("CUDA error: device-side assert triggered\n")
    assert f" *   index_select  float32[100, 16]@cuda:0 int int64[8]@cuda:0  @ {EMB}  (step 1)" in text
    assert "5 of them" in text and "_local_scalar_dense  float32[]@cuda:0  @ -  (step 1)  raised" in text
    assert out["suspects"] == [{"scope": EMB, "ops": 2, "names": ["embedding"]},  # index_select: nested in it
                               {"scope": HEAD, "ops": 2, "names": ["linear"]},
                               {"scope": "", "ops": 1, "names": ["_local_scalar_dense"]}]
    assert f"   {EMB}: 2 op(s): embedding" in text


def test_with_cuda_launch_blocking_the_op_that_raised_is_the_one(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    contents = ring(tmp_path, OPS[:5])
    out = describe(contents, "device_assert", message=ASSERT)
    assert out["launch_blocking"] is True and "was set" in out["advice"][0]
    recovered = describe(contents, "device_assert", message=ASSERT, live=False)  # not the process that failed
    assert recovered["launch_blocking"] is None and "Confirm by running again" in recovered["advice"][0]


def test_a_copy_to_the_host_is_a_wait_and_a_cpu_op_is_not(tmp_path):
    ops = [("copy_", "", "float32[4]@cpu float32[4]@cuda:0 bool", 0), ("add.Tensor", "", "float32[4]@cuda:0 "
           "float32[4]@cuda:0", 0), ("_local_scalar_dense", "", "float32[]@cpu", 0),
           ("mul.Tensor", "", "float32[4]@cuda:0 float32[4]@cuda:0", 1)]
    out = describe(ring(tmp_path, ops), "illegal_memory_access", message=ILLEGAL)
    assert [o["since_wait"] for o in out["ops"]] == [False, True, True, True] and out["ops_since_wait"] == 3
    assert "compute-sanitizer" in " ".join(out["advice"])


def test_at_module_granularity_the_modules_are_named_and_op_granularity_advised(tmp_path):
    out = describe(ring(tmp_path, [], modules=["Default/net-Net", EMB, EMB, HEAD]), "device_assert", message=ASSERT)
    assert out["ops"] == [] and out["ops_since_wait"] == 0 and out["modules"] == ["Default/net-Net", EMB, HEAD]
    assert '"granularity": "op"' in " ".join(out["advice"])
    assert f"Default/net-Net > {EMB} > {HEAD}" in explanation_text(out)


def test_an_oom_names_the_module_that_raised_and_marks_no_wait(tmp_path):
    out = describe(ring(tmp_path, OPS[:5]), "cuda_oom", message=OOM,
                   fault={"kind": "module_error", "where": EMB})
    assert out["module"] == EMB and out["asynchronous"] is False and out["ops_since_wait"] is None
    assert not any(o["since_wait"] for o in out["ops"])
    assert "memory_summary.txt" in " ".join(out["advice"]) and "CUDA_LAUNCH_BLOCKING" not in " ".join(out["advice"])
    assert "*" not in explanation_text(out)


def test_the_module_is_the_innermost_open_one_without_a_module_fault(tmp_path):
    out = describe(ring(tmp_path, [], modules=["Default/net-Net", EMB]), "cuda_error", message="CUDA error: x")
    assert out["module"] == EMB and out["asynchronous"] is False


def test_the_bundle_part_names_the_fault_or_nothing(tmp_path):
    contents = ring(tmp_path, OPS)
    short, files = bundle_part(contents, error=torch.OutOfMemoryError(OOM), exception=None, fault=None, live=True)
    assert short == {"kind": "cuda_oom", "title": "CUDA out of memory", "asynchronous": False, "module": None}
    assert json.loads(files["device_fault.json"])["kind"] == "cuda_oom" and files["device_fault.txt"].startswith(
        "CUDA out of memory. Tried to allocate 20.00 GiB")
    assert bundle_part(contents, error=ValueError("x"), exception=None, fault=None, live=True) == (None, {})
    assert bundle_part(contents, error=None, exception=None, fault=None, live=False) == (None, {})


def test_without_the_exception_the_recorded_text_says_it(tmp_path):
    """A fault dumped at the end of the recording, or a recovered ring: the fault's text, else the ring's."""
    contents = ring(tmp_path, OPS)
    assert fault_message(None, {"kind": "module_error", "error": f"AcceleratorError: {ASSERT}"}, contents)[0] == \
        "device_assert"
    writer = RingWriter(str(tmp_path / "b.obsring"), SMALL, pid=1, rank=0, world_size=1, meta={})
    writer.blob(Kind.FAULT, {"fault": "module_error", "detail": EMB, "error": f"OutOfMemoryError: {OOM}"})
    with_blob = read_ring(bytes(writer.buffer()))
    writer.close(remove=True)
    assert fault_message(None, None, with_blob, live=False) == ("cuda_oom", f"OutOfMemoryError: {OOM}")
    assert fault_message(None, None, with_blob) == (None, "")  # a live snapshot after a caught OOM is no OOM bundle


def test_a_bug_here_costs_only_the_device_fault_files(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr(device_faults, "describe", broken)
    contents = ring(tmp_path, OPS)
    old = set_raise_internal_errors(False)
    try:
        assert bundle_part(contents, error=torch.OutOfMemoryError(OOM), exception=None, fault=None,
                           live=True) == (None, {})
    finally:
        set_raise_internal_errors(old)
    assert internal_error_counts()["RDR bundle: device fault"] >= 1

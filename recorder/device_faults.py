"""What a CUDA fault was, from its exception and the ring: a device-side assert, an illegal memory access, an out of
memory or another CUDA error; and what was launched before it.

CUDA runs kernels asynchronously.  A kernel that fails (a device-side assert, an out-of-bounds access) is reported
at a later call that checks the device (``.item()``, a copy to the host, the next launch or allocation), in an op
or module that has nothing to do with it.  :func:`describe` says so and names what the ring holds of what was
launched before: the newest ops (``op`` granularity) with their modules, marked where they came after the last op
that waited for the device and succeeded (the failing kernel is among those when one thread and one stream launch
them), or the modules entered (``module`` granularity); and how to confirm: rerun with ``CUDA_LAUNCH_BLOCKING=1``,
every launch then waits for its kernel and the op that fails raises itself.

Pure: an exception (or its recorded text) and a ring's contents in, a JSON-ready record out; no torch import.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from obs._core.internal import report_internal_error
from recorder.layout import Kind
from recorder.ring_reader import RingContents

__all__ = ["ASYNCHRONOUS", "KINDS", "OPS_SHOWN", "bundle_part", "classify", "classify_text", "describe",
           "explanation_text", "fault_message"]

#: kind → what ``obs rdr show`` calls it
KINDS = {"device_assert": "device-side assert", "illegal_memory_access": "illegal memory access",
         "cuda_oom": "CUDA out of memory", "cuda_error": "CUDA error"}
#: the kinds a kernel reports after the fact (a ``cuda_error`` may be one too: see ``asynchronous`` in the record)
ASYNCHRONOUS = frozenset({"device_assert", "illegal_memory_access"})
OPS_SHOWN = 32  #: the newest ops named in the record
_SYNC_OPS_SHOWN = 12  #: the newest ops named for a fault raised where it happened (an out of memory)
_SUSPECTS_SHOWN = 64  #: the modules named among the ops since the last wait
_MODULES_SHOWN = 12  #: the newest module entries named when the ring holds no ops
_CHAIN = 8  #: causes and contexts looked at, at most

_MESSAGES = (  # (phrase, kind), first match wins: the phrases CUDA and PyTorch put in the message
    ("device-side assert triggered", "device_assert"),
    ("illegal memory access was encountered", "illegal_memory_access"),
    ("cuda out of memory", "cuda_oom"),
    ("cuda error: out of memory", "cuda_oom"),
    ("cublas_status_alloc_failed", "cuda_oom"),
    ("cuda error", "cuda_error"),
    ("cuda driver error", "cuda_error"),
    ("cublas_status_", "cuda_error"),
    ("cudnn_status_", "cuda_error"),
)
#: a kernel's failure reported after the fact, besides the asserts and illegal accesses
_KERNEL_FAULTS = ("unspecified launch failure", "misaligned address", "illegal instruction", "invalid program counter",
                  "hardware stack error", "launch timed out", "cublas_status_execution_failed")
#: ops that wait for the device (a value or a size read on the host); ``copy_`` waits when it copies to the host
_WAITS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal", "allclose",
                    "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "repeat_interleave"})
_DEVICE = re.compile(r"@([a-z]+)(?::\d+)?")


def classify(error: BaseException) -> str | None:
    """The kind of CUDA fault ``error`` is (or the cause or context it was raised from), or None."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo and len(seen) < _CHAIN:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        kind = _by_type(exc) or classify_text(str(exc))
        if kind is not None:
            return kind
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    return None


def _by_type(exc: BaseException) -> str | None:
    module, name = type(exc).__module__, type(exc).__name__
    if module.split(".")[0] != "torch":
        return None
    if name == "OutOfMemoryError":  # torch.OutOfMemoryError, also torch.cuda.OutOfMemoryError
        return "cuda_oom"
    if name == "AcceleratorError":  # torch.AcceleratorError: a CUDA call failed; its message says which way
        return classify_text(str(exc)) or "cuda_error"
    return None


def classify_text(text: str) -> str | None:
    """The kind of CUDA fault an exception's text says it is (its message, or ``Type: message`` as a fault
    recorded in the ring keeps it), or None."""
    low = text.lower()
    if "outofmemoryerror" in low and "mps" not in low:
        return "cuda_oom"
    return next((kind for phrase, kind in _MESSAGES if phrase in low), None)


def describe(contents: RingContents, kind: str, *, message: str = "", exception: dict[str, Any] | None = None,
             fault: dict[str, Any] | None = None, live: bool = True) -> dict[str, Any]:
    """The record of a fault of ``kind``: what it is, where it surfaced, the module that raised, the ops (or modules)
    launched before it from ``contents``, and what to do.  ``exception``: the bundle's exception record
    (:func:`recorder.stacks.exception_record`); ``fault``: the bundle's fault; ``live``: written by the process
    that failed (its ``CUDA_LAUNCH_BLOCKING`` is known)."""
    low = message.lower()
    asynchronous = kind in ASYNCHRONOUS or (kind == "cuda_error" and any(p in low for p in _KERNEL_FAULTS))
    blocking = os.environ.get("CUDA_LAUNCH_BLOCKING", "") == "1" if live else None
    slots, last_wait = _op_slots(contents)
    ops = _ops(contents, slots, last_wait, asynchronous)
    summary = contents.summary()
    record: dict[str, Any] = {
        "kind": kind, "title": KINDS.get(kind, kind), "asynchronous": asynchronous,
        "message": message.strip().splitlines()[0][:500] if message.strip() else "",
        "surfaced_at": _surfaced(exception), "raised_in": (exception or {}).get("raised_in"),
        "module": _module(fault, summary), "launch_blocking": blocking,
        "ops": ops, "ops_since_wait": len(slots) - 1 - last_wait if asynchronous else None,
        "suspects": _suspects(contents, slots, last_wait) if asynchronous else [],
        "modules": [] if ops else _modules(contents), "granularity": contents.header.meta.get("granularity"),
    }
    record["advice"] = _advice(record)
    return record


def _surfaced(exception: dict[str, Any] | None) -> dict[str, Any] | None:
    """The user's frame where the fault surfaced, with its line of code."""
    where = (exception or {}).get("where")
    if not isinstance(where, dict):
        return None
    code = next((f.get("code", "") for f in reversed((exception or {}).get("frames") or [])
                 if isinstance(f, dict) and (f.get("file"), f.get("line")) == (where.get("file"), where.get("line"))),
                "")
    return {**where, "code": code if len(code) <= 200 else code[:199] + "…"}


def _module(fault: dict[str, Any] | None, summary: dict[str, Any]) -> str | None:
    """The module that raised: the fault's (a module's error), else the innermost one still open."""
    if fault and fault.get("kind") == "module_error" and fault.get("where"):
        return str(fault["where"])
    opened = summary.get("open_modules") or []
    return str(opened[-1]) if opened else None


def _op_slots(contents: RingContents) -> tuple[np.ndarray, int]:
    """The ring's op slots, and the index of the newest that waited for the device and succeeded (-1: none)."""
    slots = contents.slots[contents.slots["kind"] == Kind.OP]
    waiting = [sid for sid, text in enumerate(contents.strings) if text.split(".")[0] in _WAITS | {"copy_"}]
    hits = np.nonzero(np.isin(slots["a"], waiting) & ((slots["flags"] & 1) == 0))[0]
    for i in hits[::-1].tolist():
        if _waits(contents.string(int(slots["a"][i])), contents.string(int(slots["d"][i]))):
            return slots, i
    return slots, -1


def _ops(contents: RingContents, slots: np.ndarray, last_wait: int, asynchronous: bool) -> list[dict[str, Any]]:
    """The newest ops, oldest first; ``since_wait`` (for a fault reported after the fact): launched after the newest
    op that waited for the device and succeeded (with ``CUDA_LAUNCH_BLOCKING`` unset, the failing kernel is one of
    these)."""
    first = max(0, len(slots) - (OPS_SHOWN if asynchronous else _SYNC_OPS_SHOWN))
    steps = contents.steps(slots["seq"][first:])
    out = []
    for i, (slot, step) in enumerate(zip(slots[first:], steps.tolist()), start=first):
        inputs = contents.string(int(slot["d"]))
        devices = _DEVICE.findall(inputs)
        out.append({"seq": int(slot["seq"]), "step": int(step), "name": contents.string(int(slot["a"])),
                    "scope": contents.string(int(slot["b"])), "inputs": inputs,
                    "device": next((d for d in devices if d != "cpu"), devices[0] if devices else None),
                    "nested": bool(slot["flags"] & 2), "raised": bool(slot["flags"] & 1),
                    "since_wait": asynchronous and i > last_wait})
    return out


def _suspects(contents: RingContents, slots: np.ndarray, last_wait: int) -> list[dict[str, Any]]:
    """Every op since the last wait, by module (in the order each module first launched one): the module, how many
    ops, the first few op names.  The newest :data:`OPS_SHOWN` ops are only a window on these."""
    since = slots[last_wait + 1:]
    scopes, first, counts = np.unique(since["b"], return_index=True, return_counts=True)
    out = []
    for at in np.argsort(first, kind="stable")[:_SUSPECTS_SHOWN].tolist():
        mine = since[(since["b"] == scopes[at]) & ((since["flags"] & 2) == 0)]  # nested ops: inside the ones named
        names = list(dict.fromkeys(contents.string(int(a)) for a in mine["a"][:64].tolist()))
        out.append({"scope": contents.string(int(scopes[at])), "ops": int(counts[at]), "names": names[:6]})
    return out


def _waits(name: str, inputs: str) -> bool:
    """Whether an op waited for a CUDA device: one that reads a device value on the host, or a copy to the host."""
    devices = _DEVICE.findall(inputs)
    if "cuda" not in devices:
        return False
    base = name.split(".")[0]
    return base in _WAITS or (base == "copy_" and devices[:2] == ["cpu", "cuda"])


def _modules(contents: RingContents) -> list[str]:
    """The newest modules entered, oldest first (consecutive repeats once): what the ring says at module granularity."""
    enters = contents.slots[contents.slots["kind"] == Kind.MODULE_ENTER]
    names: list[str] = []
    for sid in enters["a"][-_MODULES_SHOWN * 4:].tolist():
        name = contents.string(int(sid))
        if not names or names[-1] != name:
            names.append(name)
    return names[-_MODULES_SHOWN:]


def _advice(r: dict[str, Any]) -> list[str]:
    out = []
    if r["asynchronous"]:
        if r["launch_blocking"]:
            out.append("CUDA_LAUNCH_BLOCKING=1 was set: every launch waited for its kernel, so the op that raised is "
                       "the one that failed.")
        else:
            out.append("CUDA reports a kernel's failure at a later call: where it surfaced is not where it happened. "
                       "The failing kernel is among the ops launched before it"
                       + (f" ({r['ops_since_wait']} since the device was last waited for)" if r["ops"] else "")
                       + ". Confirm by running again with CUDA_LAUNCH_BLOCKING=1 (slower: every launch waits for its "
                       "kernel), e.g. `CUDA_LAUNCH_BLOCKING=1 obs run ...`: the op that fails then raises itself.")
        if not r["ops"]:
            out.append('The ring holds no ops: set "granularity": "op" in the rdr section to have the ops launched '
                       "before a fault named.")
        out.append("The process's CUDA context is broken after this error: restart the process.")
    if r["kind"] == "device_assert":
        out.append("A device-side assert is most often an index out of range: an embedding's or gather's indices, "
                   "cross_entropy's targets outside [0, classes). Check them against the sizes on the CPU.")
    elif r["kind"] == "illegal_memory_access":
        out.append("An illegal memory access is a kernel reading or writing outside its memory (a custom or Triton "
                   "kernel, wrong sizes or strides, a tensor freed while another stream used it); "
                   "compute-sanitizer python ... names the kernel.")
    elif r["kind"] == "cuda_oom":
        out.append("memory_summary.txt holds torch.cuda.memory_summary() at the fault; with rdr.memory_history "
                   "set, memory_snapshot.json holds the allocator's newest events with their Python stacks.")
    return out


def explanation_text(record: dict[str, Any]) -> str:
    """``device_fault.txt``: the record for a reader."""
    title, message = str(record["title"]), str(record.get("message") or "")
    lines = [message if title.lower() in message.lower() else f"{title}: {message}" if message else title]
    where = record.get("surfaced_at")
    if where:
        said = "surfaced at" if record.get("asynchronous") else "raised at"
        lines.append(f"{said} {where.get('file')}:{where.get('line')} in {where.get('function')}"
                     + (f"  — {where['code']}" if where.get("code") else ""))
    if record.get("module"):
        lines.append(f"module: {record['module']}")
    if record.get("ops"):
        waited = record.get("ops_since_wait")
        lines.append("ops launched before it (newest last" + (f"; * after the last wait for the device, {waited} of "
                                                              "them" if waited is not None else "") + "):")
        for op in record["ops"]:
            mark = "*" if op["since_wait"] else " "
            lines.append(f" {mark} {'  ' if op['nested'] else ''}{op['name']}  {op['inputs']}  @ {op['scope'] or '-'}"
                         f"  (step {op['step']}){'  raised' if op['raised'] else ''}")
    if record.get("suspects"):
        lines.append(f"all {record['ops_since_wait']} ops since the last wait for the device, by module (in the order "
                     "each first launched one):")
        lines += [f"   {m['scope'] or '-'}: {m['ops']} op(s): {', '.join(m['names'])}" for m in record["suspects"]]
    if not record.get("ops") and record.get("modules"):
        lines.append("modules entered before it (newest last): " + " > ".join(record["modules"]))
    lines += [f"- {line}" for line in record.get("advice", [])]
    return "\n".join(lines) + "\n"


def fault_message(error: BaseException | None, fault: dict[str, Any] | None, contents: RingContents, *,
                  live: bool = True) -> tuple[str | None, str]:
    """(kind, message) of the bundle's fault: its exception, else the fault's recorded text, else (a ring recovered
    after its process died: ``live`` False) the newest fault in the ring that recorded an error; (None, "") when none
    is a CUDA fault.  A live bundle of another reason (a snapshot, a hang) is not named after an older fault."""
    if error is not None:
        kind = classify(error)
        return (kind, str(error)) if kind else (None, "")
    texts = [str(fault["error"])] if fault and fault.get("error") else []
    if not live:
        texts += [str(p["error"]) for _s, _t, k, p in reversed(contents.blobs) if k == "fault" and p.get("error")][:1]
    for text in texts:
        kind = classify_text(text)
        if kind is not None:
            return kind, text
    return None, ""


def bundle_part(contents: RingContents, *, error: BaseException | None, exception: dict[str, Any] | None,
                fault: dict[str, Any] | None, live: bool) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(the manifest's ``device_fault``, the files ``device_fault.json`` and ``device_fault.txt``) of a bundle whose
    fault is a CUDA fault; (None, {}) otherwise.  Never raises: a bug here costs the bundle only these files."""
    try:
        kind, message = fault_message(error, fault, contents, live=live)
        if kind is None:
            return None, {}
        record = describe(contents, kind, message=message, exception=exception, fault=fault, live=live)
        short = {k: record[k] for k in ("kind", "title", "asynchronous", "module")}
        return short, {"device_fault.json": json.dumps(record, indent=2, default=str),
                       "device_fault.txt": explanation_text(record)}
    except Exception as exc:  # noqa: BLE001 - the rest of the bundle goes out
        report_internal_error("RDR bundle: device fault", exc)
        return None, {}

"""CUDA memory in the Running Data Recorder's bundles: ``memory_summary.txt`` in a CUDA out-of-memory bundle, and
with ``rdr.memory_history`` the allocator's newest events in ``memory_snapshot.json``.

``rdr.memory_history: N`` (0, the default: off) has PyTorch's CUDA caching allocator keep its newest N events
(allocations, frees, segment allocations, the OOM) with the Python stack of each allocation:
``torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=N)``.  It
costs a few µs per allocation (PyTorch's figure: about 2 µs per Python stack).  Only the history obs turned on is
turned off again.  torch is imported only when the option is on or a bundle holds a CUDA out of memory.

A snapshot is written as JSON, never pickle (bundles hold no pickle), bounded: the newest ``N`` events per device,
at most :data:`FRAMES_KEPT` frames per stack (innermost first, as PyTorch gives them), at most :data:`BLOCKS_KEPT`
blocks of the segments.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

from obs._core.internal import report_internal_error

__all__ = ["BLOCKS_KEPT", "FRAMES_KEPT", "MemoryHistory", "add_to_bundle", "bounded_snapshot", "summary_text"]

FRAMES_KEPT = 16
BLOCKS_KEPT = 20_000
NO_CUDA = "no CUDA memory to summarise: CUDA is not initialised in this process\n"
logger = logging.getLogger("obs")


class MemoryHistory:
    """Keeps the CUDA allocator's history in line with ``rdr.memory_history`` (``entries``: what obs turned on)."""

    def __init__(self) -> None:
        self.entries = 0
        self._noted = False

    def apply(self, entries: int) -> None:
        """Turn the history on with ``entries`` events kept, or off (0); a no-op when nothing changes."""
        if entries == self.entries:
            return
        try:
            torch = _cuda_torch()
            if torch is None:
                if entries and not self._noted:
                    self._noted = True
                    logger.info("obs: rdr.memory_history is set but this process has no CUDA: nothing is recorded")
                self.entries = 0
                return
            if entries:
                torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                         max_entries=entries)
            else:
                torch.cuda.memory._record_memory_history(enabled=None)
            self.entries = entries
        except Exception as exc:  # noqa: BLE001 - the recorder goes on without the history
            from recorder.device_faults import classify

            if not entries and classify(exc) is not None:  # turning it off after a CUDA fault broke the context
                self.entries = 0
                return
            report_internal_error("rdr memory history", exc)

    def forget(self) -> None:
        """In a forked child: the parent's history is not the child's to turn off."""
        self.entries = 0


def _cuda_torch() -> Any:
    """torch, when it is installed and CUDA is available; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def add_to_bundle(files: dict[str, Any], history: int) -> None:
    """A bundle's files before they are written: for a CUDA out of memory (its ``device_fault.json``), add
    ``memory_summary.txt`` and, with ``history`` events recorded, ``memory_snapshot.json``.  Never raises."""
    try:
        raw = files.get("device_fault.json")
        record = json.loads(raw) if isinstance(raw, str) else {}
        if record.get("kind") != "cuda_oom":
            return
        device = _device_of(str(record.get("message", "")))
        files["memory_summary.txt"] = summary_text(device)
        if history > 0:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                snapshot = bounded_snapshot(torch.cuda.memory._snapshot(), history)
                files["memory_snapshot.json"] = json.dumps(snapshot, separators=(",", ":"), default=str)
    except Exception as exc:  # noqa: BLE001 - the rest of the bundle goes out
        report_internal_error("RDR bundle: CUDA memory", exc)


def _device_of(message: str) -> int | None:
    """The device an out-of-memory message names (``GPU 0 has a total capacity of ...``), if any."""
    found = re.search(r"\bGPU (\d+)\b", message)
    return int(found.group(1)) if found else None


def summary_text(device: int | None) -> str:
    """``torch.cuda.memory_summary()`` of ``device`` (None: the current one) with what the driver says is free; or
    :data:`NO_CUDA`.  Never initialises CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return NO_CUDA
    if device is None or device >= torch.cuda.device_count():
        device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    head = (f"device cuda:{device} ({torch.cuda.get_device_name(device)}): the driver reports {free / 2**30:.2f} GiB "
            f"free of {total / 2**30:.2f} GiB (other processes' memory included)\n")
    return head + str(torch.cuda.memory_summary(device))


def bounded_snapshot(snapshot: dict[str, Any], entries: int) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``'s dict, bounded (see the module's docstring) and JSON-ready."""
    left_out = {"trace_entries": 0, "blocks": 0, "frames": 0}

    def frames(item: dict[str, Any]) -> dict[str, Any]:
        out = dict(item)
        stack = out.get("frames")
        if isinstance(stack, list) and len(stack) > FRAMES_KEPT:
            left_out["frames"] += len(stack) - FRAMES_KEPT
            out["frames"] = stack[:FRAMES_KEPT]
        return out

    traces = []
    for trace in snapshot.get("device_traces") or []:
        left_out["trace_entries"] += max(0, len(trace) - entries)
        traces.append([frames(e) for e in trace[-entries:]])
    segments, blocks = [], 0
    for segment in snapshot.get("segments") or []:
        kept = segment.get("blocks") or []
        room = max(0, BLOCKS_KEPT - blocks)
        left_out["blocks"] += max(0, len(kept) - room)
        kept = [frames(b) for b in kept[:room]]
        blocks += len(kept)
        segments.append({**frames(segment), "blocks": kept})
    return {"source": "torch.cuda.memory._snapshot()", "max_entries": entries, "frames_kept": FRAMES_KEPT,
            "left_out": left_out, "segments": segments, "device_traces": traces,
            "allocator_settings": snapshot.get("allocator_settings")}

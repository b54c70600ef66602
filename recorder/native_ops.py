"""Op records from PyTorch's own RecordFunction: the native observer, built once and attached to a ring.

``recorder/_op_observer.cpp`` is compiled against the installed torch the first time op granularity
needs it (or ahead of time with ``obs native build``), into obs's cache of native builds
(:mod:`obs._core.native`).  It is loaded with ctypes.  Where it cannot be built (no compiler, no C hot path) or
``OBS_NATIVE_OPS=0`` asks for the fallback, :func:`attach` returns None, the recorder keeps the Python dispatch mode,
and the log says why, once.

The observer sees every aten op of every thread (the autograd engine's, DataLoader threads' in
this process, ops issued from C++), not only those the Python dispatch mode sees on the thread
that runs it; nested ops are flagged.  It cannot see obs's own suppression of its tensor work.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

from obs._core import native
from recorder.hotpath import hotpath

__all__ = ["EXTENSION", "OpObserver", "attach", "unavailable_reason"]

logger = logging.getLogger("obs")
_lock = threading.Lock()
_attached: OpObserver | None = None

EXTENSION = native.Extension(
    "obs_op_observer", "native op observer",
    (os.path.join(os.path.dirname(os.path.abspath(__file__)), "_op_observer.cpp"),), part="OPS", library=True,
    fallback="op events use the Python dispatch mode (slower): the native op observer is off")
unavailable_reason = EXTENSION.unavailable_reason


def _library() -> ctypes.CDLL | None:
    lib: ctypes.CDLL | None = EXTENSION.load()
    if lib is not None and lib.obs_ops_recorded.restype is not ctypes.c_uint64:
        lib.obs_ops_attach.restype = ctypes.c_int
        lib.obs_ops_attach.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.obs_ops_detach.restype = None
        lib.obs_ops_detach.argtypes = []
        lib.obs_ops_recorded.restype = ctypes.c_uint64
    return lib


class OpObserver:
    """Recording ops of one ring's ``op`` region until :meth:`release` (which also serves as a SlotWriter's)."""

    step = 0  # the recorder sets ``step`` on its writers; op slots carry no step

    def __init__(self, lib: ctypes.CDLL, ring: Any, *, inputs: bool) -> None:
        target = ring.slots("op")
        self._lib, self.pid = lib, os.getpid()
        # released in release()
        self._view: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * len(target.mm)).from_buffer(target.mm)
        api = hotpath().native_api()
        status = lib.obs_ops_attach(ctypes.addressof(self._view) + target.base, target.capacity,
                                    target.counter.address, target.seq.address, ring.table.address,
                                    api["strings_append"], api["current_scope"], int(inputs))
        if status != 0:
            self._view = None
            raise RuntimeError("the native op observer is already recording another ring")

    def recorded(self) -> int:
        """Ops recorded by the observer in this process so far."""
        return int(self._lib.obs_ops_recorded())

    def release(self) -> None:
        global _attached
        if self._view is None:
            return
        if os.getpid() == self.pid:  # a forked child: the fork handler already stopped it; its locks may be held
            self._lib.obs_ops_detach()
        self._view = None
        with _lock:
            if _attached is self:
                _attached = None


def attach(ring: Any, module_writer: Any, *, inputs: bool = True) -> OpObserver | None:
    """Record the ops of this process into ``ring`` natively; None (and one log line) where that cannot be done.

    ``module_writer`` is the ring's C module SlotWriter: it keeps each thread's scope stack for the
    observer.  One ring at a time: a second ring keeps the Python dispatch mode.
    """
    global _attached
    if module_writer is None or getattr(ring, "table", None) is None:
        return None  # the C hot path is not built, or OBS_NATIVE_RECORDER=0 asks for the Python one
    with _lock:
        lib = _library()
        if lib is None or _attached is not None:
            return None
        module_writer.track_scope = True
        _attached = OpObserver(lib, ring, inputs=inputs)
        return _attached

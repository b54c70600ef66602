"""Op records from PyTorch's own RecordFunction: the native observer, built once and attached to a ring.

``recorder/_op_observer.cpp`` is compiled against the installed torch the first time op granularity
needs it (or ahead of time with ``python -m recorder.native_ops``), into obs's cache of native builds
(:mod:`obs._core.native_build`).  It is loaded with ctypes.  Where it cannot be built (no compiler, no C hot path) or
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

from obs._core import native_build

__all__ = ["OpObserver", "attach", "build", "unavailable_reason"]

logger = logging.getLogger("obs")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_op_observer.cpp")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None  # why there is no library (set once a build was tried)
_attached: OpObserver | None = None


def build() -> str:
    """Compile the observer (or find it built) and return the shared library's path; raises on failure."""
    return native_build.build("obs_op_observer", "native op observer", _SOURCE)


def _load() -> ctypes.CDLL | None:
    global _library, _reason
    if _library is not None or _reason is not None:
        return _library
    try:
        lib = ctypes.CDLL(build())
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback, and say why
        lines = str(exc).strip().splitlines()
        _reason = f"it could not be built ({lines[-1] if lines else type(exc).__name__})"
        return None
    lib.obs_ops_attach.restype = ctypes.c_int
    lib.obs_ops_attach.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.obs_ops_detach.restype = None
    lib.obs_ops_detach.argtypes = []
    lib.obs_ops_recorded.restype = ctypes.c_uint64
    _library = lib
    return lib


def unavailable_reason() -> str | None:
    """Why the native observer is not used (None when it is, or has not been asked for yet)."""
    return _reason


class OpObserver:
    """Recording ops of one ring's ``op`` region until :meth:`release` (which also serves as a SlotWriter's)."""

    step = 0  # the recorder sets ``step`` on its writers; op slots carry no step

    def __init__(self, lib: ctypes.CDLL, ring: Any, *, inputs: bool) -> None:
        from recorder import _hotpath

        target = ring.slots("op")
        self._lib, self.pid = lib, os.getpid()
        self._view = (ctypes.c_char * len(target.mm)).from_buffer(target.mm)  # released in release()
        api = _hotpath.native_api()
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
        return None  # the C hot path is not built, or OBS_RDR_PURE_PYTHON asks for the Python one
    if native_build.switched_off("OBS_NATIVE_OPS"):
        return None  # asked for the dispatch mode
    with _lock:
        had_reason = _reason is not None
        lib = _load()
        if lib is None:
            if not had_reason:
                logger.warning("obs: op events use the Python dispatch mode (slower): the native op observer is "
                               "off: %s", _reason)
            return None
        if _attached is not None:
            return None
        module_writer.track_scope = True
        _attached = OpObserver(lib, ring, inputs=inputs)
        return _attached


if __name__ == "__main__":  # python -m recorder.native_ops: build ahead of time (CI, images)
    print(build())

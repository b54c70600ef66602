"""Every thread's Python stack and an exception's traceback, as plain data and text."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import threading
import traceback
from typing import Any

__all__ = ["WRAPPER_FILES", "all_stacks", "exception_record", "is_hidden", "is_library", "is_wrapper", "stacks_text",
           "user_frames"]


#: obs's packages: their frames are obs's own, never the user's
_PACKAGES = ("obs", "recorder", "printsink", "exporters")
#: obs's frames that wrap a user's call (the module wrapper, the op dispatch mode); matched as path suffixes so
#: that a bundle written on another machine is read the same way
WRAPPER_FILES = tuple(os.sep + os.path.join("obs", "runtime", "torch", name) for name in ("_modules.py", "_ops.py"))
_LIBRARY = tuple(sorted({p + os.sep for p in (sysconfig.get_paths().get(k) for k in
                                              ("stdlib", "platstdlib", "purelib", "platlib")) if p}))


#: the recorder's dump and signal machinery: a thread waiting in it (the main thread while a signal's dump runs
#: on the watcher) shows the frame it was in before, not these
_MACHINERY = tuple(os.sep + os.path.join("recorder", name) for name in
                   ("signals.py", "triggers.py", "recorder.py", "bundle.py", "assemble.py", "stacks.py"))


@functools.cache
def _package_dirs() -> tuple[str, ...]:
    """The folders of obs's packages, each from its module's ``__file__`` (a package not imported here is only
    looked up, not imported: ``obs rdr show`` filters the frames of bundles written by this installation)."""
    out = []
    for name in _PACKAGES:
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin is None:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            origin = spec.origin if spec is not None else None
        if origin:
            out.append(os.path.dirname(os.path.abspath(origin)) + os.sep)
    return tuple(out)


def is_hidden(filename: str) -> bool:
    """A frame the user is never shown: obs's own (its packages ``obs``, ``recorder``, ``printsink``,
    ``exporters``) or runpy's (``obs run``, ``python -m``)."""
    return filename == "<frozen runpy>" or filename.endswith(os.sep + "runpy.py") \
        or filename.startswith(_package_dirs())


def user_frames(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """``frames`` (outermost first) as they would be without obs: from the script's first frame under ``obs run``,
    cut where obs's op dispatch mode begins (with torch's plumbing around it), and without any frame of obs or
    runpy.  Empty when no frame is the user's or a library's."""
    return [f for f in _without_wrappers(frames) if not is_hidden(f.filename)]


def all_stacks() -> list[dict[str, Any]]:
    """One entry per live thread: name, ident, daemon flag, frames (file, line, function, code) outermost first.

    A thread of the user (or of a library) shows :func:`user_frames` of the frames it had before it entered the
    recorder's dump and signal machinery: no frame of obs or runpy, so the main thread of a dump made at exit may
    have none.  obs's own threads (their code is obs's) keep their frames, less those of the dump itself on the
    dumping thread and of the machinery on the others.
    """
    names = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        stack = list(traceback.extract_stack(frame))
        if not _started_by_obs(stack):
            stack = user_frames(stack[:_machinery_starts(stack)])
        elif ident == me:
            while len(stack) > 1 and is_hidden(stack[-1].filename):
                stack.pop()
        else:
            del stack[_machinery_starts(stack):]
        out.append({"thread": thread.name if thread else f"thread-{ident}", "ident": ident,
                    "daemon": bool(thread and thread.daemon), "main": thread is threading.main_thread(),
                    "frames": [_frame(f) for f in stack]})
    out.sort(key=lambda s: (not s["main"], s["thread"]))
    return out


def _started_by_obs(frames: list[traceback.FrameSummary]) -> bool:
    """A thread obs started: its first frame past ``threading``'s bootstrap is obs's."""
    first = next((f.filename for f in frames if not f.filename.endswith(os.sep + "threading.py")), None)
    return first is not None and first.startswith(_package_dirs()) and len(frames) > 1 \
        and frames[0].filename.endswith(os.sep + "threading.py")


def _machinery_starts(frames: list[traceback.FrameSummary]) -> int:
    """Where the innermost run of machinery frames (and the library calls it made, e.g. ``Event.wait``)
    begins; ``len(frames)`` when the thread is not in the machinery.  The outermost frame always stays."""
    cut = len(frames)
    for i in range(len(frames) - 1, 0, -1):
        name = frames[i].filename
        if name.endswith(_MACHINERY):
            cut = i
        elif not is_library(name):
            break
    return cut


def stacks_text(stacks: list[dict[str, Any]]) -> str:
    lines = []
    for s in stacks:
        lines.append(f'Thread "{s["thread"]}" ({s["ident"]}){" daemon" if s["daemon"] else ""}:')
        for f in s["frames"]:
            lines.append(f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}')
            if f["code"]:
                lines.append(f"    {f['code']}")
        lines.append("")
    return "\n".join(lines)


#: torch's frames around a dispatch mode's ``__torch_dispatch__`` (its decorators, OpOverload.__call__): they
#: exist only because a mode is active, so they go with obs's op wrapper frame
_DISPATCH_PLUMBING = tuple(os.sep + os.path.join("torch", *name.split("/")) for name in
                           ("_compile.py", "_dynamo/eval_frame.py", "utils/_python_dispatch.py", "_ops.py"))


#: ``obs run`` runs the script from here (through runpy): the frames down to the script's are the launcher's
_LAUNCHER = os.sep + os.path.join("obs", "cli", "_run.py")


def _without_launcher(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """Under ``obs run``: the frames from the script's first one on, as ``python script.py`` would show them."""
    at = next((i for i, f in enumerate(frames) if f.filename.endswith(_LAUNCHER)), None)
    if at is None:
        return frames
    at += 1
    while at < len(frames) - 1 and (frames[at].filename == "<frozen runpy>" or
                                    frames[at].filename.endswith(os.sep + "runpy.py")):
        at += 1
    return frames[at:]


def _without_wrappers(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """``frames`` without obs's module wrapper and ``obs run``'s launcher, and cut where obs's op dispatch mode
    begins (with torch's plumbing around it): what the traceback would be without obs."""
    out = [f for f in _without_launcher(frames) if not f.filename.endswith(WRAPPER_FILES[0])]
    cut = next((i for i, f in enumerate(out) if f.filename.endswith(WRAPPER_FILES[1])), None)
    if cut is None:
        return out
    while cut > 0 and out[cut - 1].filename.endswith(_DISPATCH_PLUMBING):
        cut -= 1
    return out[:cut] if cut > 0 else out


def is_wrapper(filename: str) -> bool:
    """A frame of obs's own machinery that a user's traceback passes through (module wrapper, dispatch mode)."""
    return filename.endswith(WRAPPER_FILES)


def is_library(filename: str) -> bool:
    """Installed code (site-packages, the standard library), as opposed to the user's own files."""
    return filename.startswith("<") or filename.startswith(_LIBRARY) or os.sep + "site-packages" + os.sep in filename \
        or os.sep + "dist-packages" + os.sep in filename


def _frame(f: traceback.FrameSummary) -> dict[str, Any]:
    return {"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line or ""}


def _drop_hidden(te: traceback.TracebackException, seen: set[int]) -> None:
    """Leave obs's (and runpy's) frames out of ``te`` and every exception chained to it; an exception whose
    frames are all obs's (an error of obs itself) keeps them, they are all there is."""
    if id(te) in seen:
        return
    seen.add(id(te))
    frames = list(te.stack)
    te.stack = traceback.StackSummary.from_list(user_frames(frames) or frames)
    for other in (te.__cause__, te.__context__):
        if other is not None:
            _drop_hidden(other, seen)


def exception_record(error: BaseException) -> dict[str, Any]:
    """Type, message, formatted traceback (with chained causes), its frames and where it was raised.

    The traceback runs from the user's outermost frame to the frame that raised: when the error is
    recorded while it is still propagating (a module or op fault, dumped from inside obs's wrapper),
    its traceback starts at the frame that caught it, and the frames outside it come from the live
    stack.  No frame of obs or runpy is in it (:func:`user_frames`).  ``where`` is the user's innermost frame;
    ``raised_in`` the innermost frame when that is library code (torch's ``linear.py``), else None.
    """
    te = traceback.TracebackException.from_exception(error)
    tb = error.__traceback__
    outer: list[traceback.FrameSummary] = []
    if tb is not None and tb.tb_frame.f_back is not None:
        outer = list(traceback.extract_stack(tb.tb_frame.f_back))
    te.stack = traceback.StackSummary.from_list(outer + list(te.stack))
    _drop_hidden(te, set())
    frames = list(te.stack)
    mine = [f for f in frames if not is_library(f.filename)]
    innermost = frames[-1] if frames else None
    user = mine[-1] if mine else innermost
    raised_in = innermost if innermost is not None and user is not innermost else None
    return {
        "type": f"{type(error).__module__}.{type(error).__qualname__}".removeprefix("builtins."),
        "message": str(error),
        "traceback": "".join(te.format()),
        "frames": [_frame(f) for f in frames],
        "where": {"file": user.filename, "line": user.lineno, "function": user.name} if user else None,
        "raised_in": {"file": raised_in.filename, "line": raised_in.lineno, "function": raised_in.name}
        if raised_in else None,
    }

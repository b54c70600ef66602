"""Every thread's Python stack and an exception's traceback, as plain data and text."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

__all__ = ["all_stacks", "exception_record", "stacks_text"]


_OURS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + pkg + os.sep
              for pkg in ("obs", "recorder"))


def all_stacks() -> list[dict[str, Any]]:
    """One entry per live thread: name, ident, daemon flag, frames (file, line, function, code) outermost first.

    The dumping thread's innermost frames that belong to obs itself (the dump machinery) are left out.
    """
    names = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line or ""}
                  for f in traceback.extract_stack(frame)]
        if ident == me:
            while len(frames) > 1 and frames[-1]["file"].startswith(_OURS):
                frames.pop()
        out.append({"thread": thread.name if thread else f"thread-{ident}", "ident": ident,
                    "daemon": bool(thread and thread.daemon), "main": thread is threading.main_thread(),
                    "frames": frames})
    out.sort(key=lambda s: (not s["main"], s["thread"]))
    return out


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


def exception_record(error: BaseException) -> dict[str, Any]:
    """Type, message, formatted traceback (with chained causes) and the innermost frame."""
    tb = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    last = tb[-1] if tb else None
    return {
        "type": f"{type(error).__module__}.{type(error).__qualname__}".removeprefix("builtins."),
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
        "where": {"file": last.filename, "line": last.lineno, "function": last.name} if last else None,
    }

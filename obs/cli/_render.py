"""Shared rendering helpers (docs/cli.md): one console per stream, never-wrapped paths, escaped text, JSON out.

- :func:`console` / :func:`err_console`: on a terminal, rich's own width; piped or redirected, a width
  so large that nothing is wrapped or cut (paths and commands stay pasteable, ``grep`` sees whole lines).
- :func:`clean` escapes control characters of text read from files (Print strings, stacks, reasons)
  so that a file cannot drive the terminal; use it on everything a file supplies before rendering.
- :func:`print_json` writes one JSON document; :func:`print_json_lines` a stream of records, one per line.
- :func:`say_written` tells, on stderr, which files a command wrote.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console

__all__ = ["WIDE", "clean", "console", "err_console", "error", "markup_text", "print_json", "print_json_lines",
           "say_written", "warning"]

WIDE = 100_000  #: the width used off a terminal: wide enough that rich never wraps a line
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _width(stream: Any) -> int | None:
    # Off a terminal nothing is wrapped, whatever COLUMNS says (a pipe has no width to fit).
    return None if stream.isatty() else WIDE


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits 1 on a closed pipe; `obs ... | head` should end quietly (main() turns this into exit 0).
        raise BrokenPipeError


def console() -> Console:
    return _Console(highlight=False, width=_width(sys.stdout), soft_wrap=not sys.stdout.isatty())


def err_console() -> Console:
    return _Console(stderr=True, highlight=False, width=_width(sys.stderr), soft_wrap=not sys.stderr.isatty())


def clean(text: Any, *, newlines: bool = True) -> str:
    """``text`` with control characters shown as ``\\xNN`` (newlines and tabs kept when ``newlines``)."""
    pattern = _CONTROL if newlines else _CONTROL_ALL
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def error(message: str) -> None:
    err_console().print(f"[bold red]obs: error:[/] {markup_text(message)}", markup=True, soft_wrap=True)


def warning(message: str) -> None:
    err_console().print(f"[yellow]obs: warning:[/] {markup_text(message)}", markup=True, soft_wrap=True)


def say_written(what: str, path: str) -> None:
    """``obs: wrote <what>: <path>`` on stderr, the path whole."""
    err_console().print(f"[dim]obs:[/] wrote {what}: {markup_text(path, newlines=False)}", markup=True,
                        soft_wrap=True)


def print_json(data: Any) -> None:
    """One JSON document (a single object)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def print_json_lines(records: Iterable[Any]) -> int:
    """A stream of records as JSON lines, flushed as they come; returns how many."""
    count = 0
    for record in records:
        sys.stdout.write(json.dumps(record, default=str, separators=(",", ":")) + "\n")
        count += 1
    sys.stdout.flush()
    return count


def markup_text(text: str, *, newlines: bool = True) -> str:
    """Text from a file or the user, ready to sit inside rich markup: control characters escaped (:func:`clean`),
    brackets never read as markup."""
    from rich.markup import escape

    return escape(clean(text, newlines=newlines))


def show_live(first: Any, refresh: Callable[[], Any], *, once: bool, interval: float) -> int:
    """Print the renderable ``first``; unless ``once``, redraw it in place with ``refresh()``'s every ``interval``
    seconds until Ctrl-C (``obs top``'s views).  Returns exit 0."""
    import time

    from rich.live import Live

    if once:
        console().print(first)
        return 0
    with Live(first, console=console(), auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(refresh(), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0

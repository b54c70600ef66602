"""Graphviz's ``dot`` program: the one call that renders DOT text, for the ``.svg`` beside each ``.dot`` at
save_graphs level 3 and for ``obs graph render``.

Graphviz is not a dependency: where ``dot`` is not on ``PATH`` a :class:`GraphvizError` says so (``missing``), and
the graph dump writes its ``.dot`` alone.
"""

from __future__ import annotations

import shutil
import subprocess

from obs._core.errors import ObsError

__all__ = ["GraphvizError", "render"]

_INSTALL = "install Graphviz: apt install graphviz on Debian/Ubuntu, brew install graphviz on macOS"


class GraphvizError(ObsError):
    """Graphviz's ``dot`` rendered nothing: it is not installed (``missing``), took too long, or failed."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def render(dot: str, *, fmt: str = "svg", timeout_s: float = 60) -> bytes:
    """``dot`` rendered by Graphviz's ``dot -T{fmt}`` within ``timeout_s`` seconds; a :class:`GraphvizError` when it
    is not installed, runs longer, or exits with an error or no output (with its stderr)."""
    program = shutil.which("dot")
    if program is None:
        raise GraphvizError(f"Graphviz's 'dot' program is not installed ({_INSTALL})", missing=True)
    try:
        done = subprocess.run([program, f"-T{fmt}"], input=dot.encode(), capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise GraphvizError(f"Graphviz's dot took more than {timeout_s:g} s") from None
    except OSError as exc:
        raise GraphvizError(f"Graphviz's dot at {program!r} could not be run ({exc})") from None
    if done.returncode != 0 or not done.stdout:
        said = done.stderr.decode("utf-8", "replace").strip()[:400] or "no output"
        raise GraphvizError(f"Graphviz's dot failed (exit status {done.returncode}): {said}")
    return done.stdout

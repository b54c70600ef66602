"""Imported by every Python process started with ``obs run``'s ``PYTHONPATH``: one that runs ``obs run``'s script again
(a launcher that re-executes it for its other ranks, as Lightning's DDP launcher does) runs it under obs, with the same
settings (:func:`obs.cli._run.follow`).  Any other process pays a look at ``sys.argv``; a ``sitecustomize`` this one
hides on ``sys.path`` still runs.  Nothing of obs is imported unless the script matches."""

from __future__ import annotations

import importlib
import os
import sys

#: obs._core.env.OBS_RUN_SCRIPT (written out: importing obs here would cost every other process; a test pins it)
_SCRIPT = "OBS_RUN_SCRIPT"


def _reruns_the_script() -> bool:
    script = os.environ.get(_SCRIPT)
    if not script or not sys.argv or not sys.argv[0] or sys.argv[0].startswith("-"):
        return False
    try:
        return os.path.samefile(sys.argv[0], script)
    except OSError:
        return False


def _run_hidden() -> None:
    """The ``sitecustomize`` that this folder, first on ``sys.path``, hides (if there is one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    mine = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    finally:
        sys.path[:] = saved


_run_hidden()
if _reruns_the_script():
    from obs.cli._run import follow

    follow()

"""``obs run SCRIPT [ARGS]``: apply settings, then run the script as ``__main__``, keeping its exit status.

A process the script starts that runs the script again (a launcher that re-executes it for its other ranks, as
Lightning's DDP launcher does with ``subprocess``) runs under obs too: ``obs run`` passes the script and its settings
on in the environment, and ``obs/cli/_inherit/sitecustomize.py``, first on ``PYTHONPATH``, applies them there
(:func:`follow`).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from typing import Any

from obs._core import env

__all__ = ["apply_settings", "follow", "pass_on", "run_script"]


def apply_settings(config: str | None, sets: list[tuple[str, Any]]) -> None:
    """``--config`` (or ``$OBS_CONFIG``) and ``--set`` pairs → one ``set_context`` call."""
    import obs

    kwargs = dict(sets)
    config = config or env.text(env.OBS_CONFIG) or None
    if config:
        kwargs["env_config_path"] = config
    if kwargs:
        obs.set_context(**kwargs)
    from obs.features.dump.feature import feature as dump_feature

    dump_feature.start_from_environment()  # MINDSPORE_DUMP_CONFIG / OBS_DUMP_CONFIG, as at a first set_context


def say_what_obs_wrote() -> None:
    """At exit, after obs's own exit work (a mode-2 bundle, the last fsync): where its files are, on stderr."""
    from obs._core.outputs import written
    from obs.features.rdr import feature as rdr_feature

    # A recorder started at import (MS_RDR_ENABLE=1) put its exit handler before this one, so it would run after
    # it: end the recording now (its last bundle, its marker), as that handler would.
    rdr_feature.close()
    items = written()
    if not items:
        return
    from obs.cli._render import say_written

    for kind, path in items:
        say_written(kind, path)


def _report_at_exit() -> None:
    # Registered first, so it runs last: after the recorder's and the print sink's own exit handlers.
    atexit.register(say_what_obs_wrote)
    from obs import profiling
    from obs.cli._trace_view import print_exit_summary

    profiling.feature.exit_listeners.append(print_exit_summary)  # the profile's summary at the end, when on


def pass_on(path: str, config: str | None, sets: list[tuple[str, Any]]) -> None:
    """Into the environment the script's children inherit: the script, the settings, and the folder of the
    ``sitecustomize`` that applies them in a child that runs the script again (see :func:`follow`)."""
    from obs.cli import _inherit

    folder = os.path.dirname(os.path.abspath(_inherit.__file__))
    before = env.text(env.PYTHONPATH)
    if before.split(os.pathsep)[0] != folder:
        os.environ[env.PYTHONPATH] = folder + (os.pathsep + before if before else "")
    os.environ[env.OBS_RUN_SCRIPT] = path
    os.environ[env.OBS_RUN_SETTINGS] = json.dumps({"config": os.path.abspath(config) if config else None,
                                                   "sets": [list(pair) for pair in sets]})


def follow() -> None:
    """In a process that runs ``obs run``'s script again (from ``sitecustomize``, before the script): the settings
    ``obs run`` applied, and its report of what obs wrote at exit.  A failure is said on stderr; the script then runs
    without obs."""
    try:
        passed = json.loads(env.text(env.OBS_RUN_SETTINGS) or "{}")
        _report_at_exit()
        apply_settings(passed.get("config"), [(k, v) for k, v in passed.get("sets", [])])
    except Exception as exc:  # noqa: BLE001 - the user's script still runs, as it would without obs run
        print(f"obs: {sys.argv[0]} runs without obs in this process (pid {os.getpid()}): its settings failed: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


def run_script(script: str, args: list[str], *, config: str | None, sets: list[tuple[str, Any]]) -> int:
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script {script!r} does not exist")
    _report_at_exit()
    apply_settings(config, sets)
    sys.argv = [script, *args]
    path = os.path.abspath(script)  # as `python script.py` sets __file__
    pass_on(path, config, sets)
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - the script's own uncaught error, shown as python would
        # Through sys.excepthook, as an uncaught exception of `python script.py` would go, so the
        # Running Data Recorder (and any hook the user installed) sees it.
        exc = exc.with_traceback(_from_script(exc.__traceback__, path))
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _from_script(tb: Any, path: str) -> Any:
    """The traceback from the script's first frame on, as ``python script.py`` shows it (no obs or runpy frames
    above it); the whole one when the script's frame is not in it (it failed to compile)."""
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename != path:
        start = start.tb_next
    return start if start is not None else tb

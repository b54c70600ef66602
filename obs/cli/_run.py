"""``obs run SCRIPT [ARGS]``: apply settings, then run the script as ``__main__``, keeping its exit status."""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

__all__ = ["apply_settings", "run_script"]


def apply_settings(config: str | None, sets: list[tuple[str, Any]]) -> None:
    """``--config`` (or ``$OBS_CONFIG``) and ``--set`` pairs → one ``set_context`` call."""
    import obs

    kwargs = dict(sets)
    config = config or os.environ.get("OBS_CONFIG") or None
    if config:
        kwargs["env_config_path"] = config
    if kwargs:
        obs.set_context(**kwargs)


def run_script(script: str, args: list[str], *, config: str | None, sets: list[tuple[str, Any]]) -> int:
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script {script!r} does not exist")
    apply_settings(config, sets)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return 130
    except BaseException:
        # Through sys.excepthook, as an uncaught exception of `python script.py` would go, so the
        # Running Data Recorder (and any hook the user installed) sees it.
        sys.excepthook(*sys.exc_info())
        return 1
    return 0

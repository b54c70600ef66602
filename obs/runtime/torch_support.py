"""The torch versions obs supports, checked without importing torch: at the first ``set_context`` and when the
PyTorch adapter loads.

obs uses torch internals, the newest of which sets the oldest release: ``TorchDispatchMode.ignore_compile_internals``
(2.9; with it Dynamo compiles as without obs while the op interceptor is on; before, it skips every frame).  The
others are older: Dynamo's ``substitute_in_graph`` (2.5) and per-code frame strategies, ``torch.library.custom_op``
(2.4), Inductor's ``post_grad_custom_post_pass``, the structured trace.  A torch newer than the newest tested gets
one warning, and obs runs: internals may have moved, but most releases keep them.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from importlib import metadata

from obs._core.errors import ObsError

__all__ = ["NEWEST", "OLDEST", "TESTED", "check", "importable", "installed"]

OLDEST = (2, 9)  #: the oldest torch release obs supports
NEWEST = (2, 14)  #: the newest release it was tested with
TESTED = ("2.13.0", "2.14.1")  #: the versions the suite ran on (docs/contributing.md)

logger = logging.getLogger("obs")
_warned: set[str] = set()


def installed() -> str | None:
    """The installed torch's version (torch's own once it is imported), or None without torch."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def importable() -> bool:
    """Whether torch can be imported here (it is already, or it is found on the path), without importing it."""
    return "torch" in sys.modules or importlib.util.find_spec("torch") is not None


def _range() -> str:
    return f"torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}.x (tested: {', '.join(TESTED)})"


def check(version: str | None = None) -> None:
    """Raise :class:`ObsError` for a torch older than :data:`OLDEST`; log one warning for one newer than
    :data:`NEWEST`, or whose version does not parse.  ``version``: the installed torch's when None."""
    version = installed() if version is None else version
    if version is None:
        return
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release is not None and release < OLDEST:
        raise ObsError(f"obs needs {_range()}; this is torch {version}, which lacks internals obs uses. "
                       f"Install a newer one (pip install 'torch>={OLDEST[0]}.{OLDEST[1]}'), or run without obs")
    if (release is None or release > NEWEST) and version not in _warned:
        _warned.add(version)
        logger.warning("obs: torch %s is %s; obs supports %s and relies on torch internals that a newer release may "
                       "have moved: if a feature fails, try a tested torch", version,
                       "newer than obs was tested with" if release else "a version obs cannot read", _range())

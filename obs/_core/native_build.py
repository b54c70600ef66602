"""C++ extensions compiled against the installed torch on first use, and kept in a cache folder.

A source is compiled with ``torch.utils.cpp_extension`` into a folder keyed by the source's hash, the torch
and Python versions and the platform: ``$OBS_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/obs/native``, else
``~/.cache/obs/native``.  A later process finds the library there and compiles nothing.  Callers decide
what a failure means (they keep a Python path) and say why, once.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from types import ModuleType

from obs._core import safe_files

__all__ = ["Extension", "build", "cache_dir", "load_module", "switched_off"]

logger = logging.getLogger("obs")


def switched_off(variable: str) -> bool:
    """Whether the environment variable ``variable`` (``OBS_NATIVE_OPS``, ``OBS_NATIVE_DUMP``) asks for the
    Python path: ``0``, ``off`` or ``false``."""
    return os.environ.get(variable, "") in ("0", "off", "false")


def cache_dir(*sources: str) -> str:
    """Where the library built from ``sources`` (the first is the one compiled, the rest its headers) is kept."""
    import torch

    root = os.environ.get("OBS_NATIVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "obs", "native")
    digest = hashlib.sha256()
    for source in sources:
        with open(source, "rb") as f:
            digest.update(f.read())
    tag = f"torch{torch.__version__}-{sys.implementation.cache_tag}-{sysconfig.get_platform()}-" \
          f"{digest.hexdigest()[:12]}"
    return os.path.join(root, tag.replace("+", "_"))


def build(name: str, label: str, *sources: str) -> str:
    """Compile ``sources[0]`` as the shared library ``name`` (or find it built) and return its path; raises on
    failure.  ``label`` names it in the one log line a build writes."""
    import torch
    from torch.utils import cpp_extension

    folder = cache_dir(*sources)
    safe_files.ensure_dir(folder)
    path = os.path.join(folder, f"{name}.so")
    if not os.path.exists(path):
        logger.warning("obs: building the %s for torch %s (once, about 30 s; kept in %s)", label, torch.__version__,
                       folder)
        # -DNDEBUG as libtorch itself: some of its structures' layouts differ in debug builds.
        cpp_extension.load(name=name, sources=[sources[0]], extra_cflags=["-O2", "-DNDEBUG"],
                           extra_include_paths=sorted({os.path.dirname(s) for s in sources}), build_directory=folder,
                           is_python_module=False, verbose=False)
    return path


def load_module(name: str, path: str) -> ModuleType:
    """Import the extension module ``name`` (it defines ``PyInit_{name}``) from the library at ``path``."""
    import torch  # noqa: F401 - its libraries first: the module links against them

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load the extension module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Extension:
    """One C++ extension, built on first use and loaded once per process; where it cannot be, why (logged once).

    ``switch`` names the environment variable that asks for the Python path instead; ``requires()`` returns why the
    extension cannot be used before any build is tried (None when it can); ``fallback`` is the log line's start."""

    def __init__(self, name: str, label: str, sources: tuple[str, ...], *, switch: str, fallback: str,
                 requires: Callable[[], str | None] = lambda: None) -> None:
        self.name, self.label, self.sources, self.switch = name, label, sources, switch
        self.fallback, self.requires = fallback, requires
        self.module: ModuleType | None = None
        self.reason: str | None = None  # why there is no module (set once a load was tried)
        self._lock = threading.Lock()

    def build(self) -> str:
        """Compile it (or find it built) and return the shared library's path; raises on failure."""
        return build(self.name, self.label, *self.sources)

    def load(self) -> ModuleType | None:
        """The module, or None where the Python path must do the work."""
        if switched_off(self.switch):
            return None
        with self._lock:
            if self.module is None and self.reason is None:
                self.reason = self.requires()
                if self.reason is None:
                    try:
                        self.module = load_module(self.name, self.build())
                    except Exception as exc:  # noqa: BLE001 - any build or load failure: the Python path, and why
                        lines = str(exc).strip().splitlines()
                        self.reason = f"it could not be built ({lines[-1] if lines else type(exc).__name__})"
                if self.reason is not None:
                    logger.warning("obs: %s: %s", self.fallback, self.reason)
        return self.module

    def unavailable_reason(self) -> str | None:
        """Why the extension is not used (None when it is, or has not been asked for yet)."""
        return f"{self.switch}=0 asks for the Python path" if switched_off(self.switch) else self.reason

"""Native code: one loader and one switch rule for every extension obs has.

Two kinds, built two ways for a reason:

* C modules that need no torch (the recorder's hot path ``recorder._hotpath``, the statistics pass
  ``obs.features.dump.stats._stats``) are built by ``setup.py`` when obs is installed: :class:`Installed`.
* C++ extensions that link against libtorch (the op observer, the statistic recorder, the NaN/Inf
  check) are compiled on first use against the torch that is installed, whose C++ ABI changes from
  release to release, and kept in a cache folder keyed by the source's hash, the torch and Python
  versions and the platform: ``$OBS_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/obs/native``, else
  ``~/.cache/obs/native``: :class:`Extension`.  ``obs native build`` builds them ahead of time.

Switch rule (same polarity everywhere): ``OBS_NATIVE=0`` asks for the Python path of every part;
``OBS_NATIVE_<PART>=0`` for one part (``RECORDER``, ``OPS``, ``STATS``, ``DUMP``).  Switches are
read each time a part is asked for, but for ``STATS``: the statistics pass asks once, when
``obs.features.dump.stats.tensor_stats`` is first imported, as it sits on the data dump's per-tensor path.
Every native part has a Python path that does the same work; a part that cannot load says why,
once, in the log.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from obs._core import env, safe_files

__all__ = ["EXTENSIONS", "PARTS", "Extension", "Installed", "Status", "cache_dir", "library_path", "status",
           "switch_name", "switched_off"]

logger = logging.getLogger("obs")

#: The parts a switch can turn off, and what each covers.
PARTS = {
    "RECORDER": "the recorder's C hot path (module events, ring slots, signal relay)",
    "OPS": "the native op observer (op events from PyTorch's RecordFunction)",
    "STATS": "the C statistics passes of the data dump, the NaN/Inf check and the monitor's norms and rule",
    "DUMP": "the data dump's C++ statistic recorder and the NaN/Inf check's C++ module hook",
}

#: Every extension declared in the process, by name (``obs native`` lists and builds them).
EXTENSIONS: dict[str, Installed | Extension] = {}


def switch_name(part: str) -> str:
    return env.OBS_NATIVE_PREFIX + part


def switched_off(part: str) -> bool:
    """Whether ``OBS_NATIVE=0`` or ``OBS_NATIVE_<part>=0`` asks for the Python path of ``part``."""
    return env.switched_off(env.OBS_NATIVE) or env.switched_off(switch_name(part))


def _switch_reason(part: str) -> str:
    name = env.OBS_NATIVE if env.switched_off(env.OBS_NATIVE) else switch_name(part)
    return f"{name}=0 asks for the Python path"


class Installed:
    """A C module built by setup.py at install time; ``load()`` is it, or None (switched off or not built).

    Its fallback is silent here: a caller whose Python path loses something says so itself (the signal relay)."""

    def __init__(self, module: str, part: str) -> None:
        self.name, self.part = module, part
        self._module: ModuleType | None = None
        self.reason: str | None = None
        EXTENSIONS[module] = self

    def load(self) -> Any:
        if switched_off(self.part):
            return None
        if self._module is None and self.reason is None:
            try:
                self._module = importlib.import_module(self.name)
            except ImportError:
                self.reason = f"the C extension {self.name} is not built"
        return self._module

    def unavailable_reason(self) -> str | None:
        """Why the module is not used (None when it is, or has not been asked for yet)."""
        return _switch_reason(self.part) if switched_off(self.part) else self.reason


def cache_dir(*sources: str) -> str:
    """Where the library built from ``sources`` (the first is the one compiled, the rest its headers) is kept."""
    import torch

    root = env.text(env.OBS_NATIVE_CACHE) or os.path.join(
        env.text(env.XDG_CACHE_HOME) or os.path.join(os.path.expanduser("~"), ".cache"), "obs", "native")
    digest = hashlib.sha256()
    for source in sources:
        with open(source, "rb") as f:
            digest.update(f.read())
    tag = f"torch{torch.__version__}-{sys.implementation.cache_tag}-{sysconfig.get_platform()}-" \
          f"{digest.hexdigest()[:12]}"
    return os.path.join(root, tag.replace("+", "_"))


def library_path(name: str, *sources: str) -> str:
    """Where the library ``name`` built from ``sources`` is (or will be) kept."""
    return os.path.join(cache_dir(*sources), f"{name}.so")


def _build(name: str, label: str, *sources: str) -> str:
    import torch
    from torch.utils import cpp_extension

    path = library_path(name, *sources)
    safe_files.ensure_dir(os.path.dirname(path))
    if not os.path.exists(path):
        folder = os.path.dirname(path)
        logger.warning("obs: building the %s for torch %s (once, about 30 s; kept in %s)", label, torch.__version__,
                       folder)
        # -DNDEBUG as libtorch itself: some of its structures' layouts differ in debug builds.
        cpp_extension.load(name=name, sources=[sources[0]], extra_cflags=["-O2", "-DNDEBUG"],
                           extra_include_paths=sorted({os.path.dirname(s) for s in sources}), build_directory=folder,
                           is_python_module=False, verbose=False)
    return path


def _load_module(name: str, path: str) -> ModuleType:
    import torch  # noqa: F401 - its libraries first: the module links against them

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load the extension module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load_library(name: str, path: str) -> ctypes.CDLL:
    import torch  # noqa: F401 - its libraries first: the library links against them

    return ctypes.CDLL(path)


class Extension:
    """One C++ extension, built on first use and loaded once per process; where it cannot be, why (logged once).

    ``library=False``: a Python extension module (it defines ``PyInit_{name}``); ``library=True``: a plain shared
    library loaded with ctypes.  ``requires()`` returns why it cannot be used before any build is tried (None when
    it can); ``fallback`` starts the log line."""

    def __init__(self, name: str, label: str, sources: tuple[str, ...], *, part: str, fallback: str,
                 requires: Callable[[], str | None] = lambda: None, library: bool = False) -> None:
        self.name, self.label, self.sources, self.part = name, label, sources, part
        self.fallback, self.requires, self.library = fallback, requires, library
        self.module: Any = None
        self.reason: str | None = None  # why there is no module (set once a load was tried)
        self._lock = threading.Lock()
        EXTENSIONS[name] = self

    def build(self) -> str:
        """Compile it (or find it built) and return the shared library's path; raises on failure."""
        return _build(self.name, self.label, *self.sources)

    def load(self) -> Any:
        """The module (or ctypes library), or None where the Python path must do the work."""
        if switched_off(self.part):
            return None
        with self._lock:
            if self.module is None and self.reason is None:
                self.reason = self.requires()
                if self.reason is None:
                    try:
                        path = self.build()
                        self.module = _load_library(self.name, path) if self.library else \
                            _load_module(self.name, path)
                    except Exception as exc:  # noqa: BLE001 - any build or load failure: the Python path, and why
                        lines = str(exc).strip().splitlines()
                        self.reason = f"it could not be built ({lines[-1] if lines else type(exc).__name__})"
                if self.reason is not None:
                    logger.warning("obs: %s: %s", self.fallback, self.reason)
        return self.module

    def unavailable_reason(self) -> str | None:
        """Why the extension is not used (None when it is, or has not been asked for yet)."""
        return _switch_reason(self.part) if switched_off(self.part) else self.reason


@dataclass(frozen=True)
class Status:
    """One extension as ``obs native status`` shows it."""

    name: str
    part: str
    built_at: str  #: "install" (setup.py) or "first use" (against the installed torch)
    state: str  #: "in use", "switched off", "not built yet" (first use will build it) or "unavailable"
    reason: str | None  #: why it is not in use

    @property
    def in_use(self) -> bool:
        return self.state == "in use"


def status(*, build: bool = False) -> list[Status]:
    """Every declared extension: loaded where it is built (``build``: compile what is not built yet first)."""
    out = []
    for ext in EXTENSIONS.values():
        built_at = "first use" if isinstance(ext, Extension) else "install"
        if switched_off(ext.part):
            out.append(Status(ext.name, ext.part, built_at, "switched off", ext.unavailable_reason()))
        elif isinstance(ext, Extension) and not build and ext.module is None and ext.reason is None \
                and not os.path.exists(library_path(ext.name, *ext.sources)):
            out.append(Status(ext.name, ext.part, built_at, "not built yet", "obs native build builds it now"))
        elif ext.load() is not None:
            out.append(Status(ext.name, ext.part, built_at, "in use", None))
        else:
            out.append(Status(ext.name, ext.part, built_at, "unavailable", ext.unavailable_reason()))
    return out


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
from types import ModuleType

from obs._core import safe_files

__all__ = ["build", "cache_dir", "load_module", "switched_off"]

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

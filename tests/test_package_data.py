"""A wheel carries every native source and header: what setup.py compiles at install, and what the C++ extensions
(obs/_core/native.py) compile on first use from the installed package.  Checked here against pyproject.toml's
package-data rule, without building a wheel; .ci/wheel_check builds one and runs it."""

from __future__ import annotations

import fnmatch
import pathlib
import re
import tomllib

from obs._core import native
from tests.conftest import native_extensions

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE_SUFFIXES = (".c", ".cpp", ".h")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages() -> list[str]:
    """The top-level packages the wheel holds (``packages.find``'s ``include``, as ``obs*``)."""
    include = _setuptools()["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*") for pattern in include})


def _shipped(path: pathlib.Path) -> bool:
    """Whether package-data ships ``path``: every folder of a package is a package of its own (``packages.find``
    finds namespace packages, pyproject's default), and a pattern is matched in its package's folder."""
    rules = _setuptools()["package-data"]
    package = ".".join(path.parent.relative_to(ROOT).parts)
    patterns = [*rules.get("*", ()), *rules.get(package, ())]
    return any(fnmatch.fnmatchcase(path.name, p) for p in patterns if "/" not in p)


def _includes(source: pathlib.Path) -> set[pathlib.Path]:
    """``source`` and every file beside it that it includes with ``#include "..."``, transitively (a name found
    nowhere beside it is the compiler's to find: torch's and Python's headers)."""
    seen: set[pathlib.Path] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        found = [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text(errors="replace"))]
        todo += [p for p in found if p.is_file()]
    return seen


def test_package_discovery_finds_folders_without_init():
    """Package data is matched per package; a folder of headers (``ryu/``) is one only as a namespace package."""
    assert _setuptools()["packages"]["find"].get("namespaces", True) is True


def test_every_native_source_and_header_is_package_data():
    in_tree = {p for package in _packages() for p in (ROOT / package).rglob("*") if p.suffix in NATIVE_SUFFIXES}
    first_use = {pathlib.Path(s).resolve() for ext in native_extensions() if isinstance(ext, native.Extension)
                 for s in ext.sources}
    assert first_use and first_use <= in_tree, first_use - in_tree
    needed = in_tree | {p for source in first_use for p in _includes(source)}
    missing = sorted(str(p.relative_to(ROOT)) for p in needed if not _shipped(p))
    assert not missing, f"not in pyproject.toml's [tool.setuptools.package-data], so no wheel carries them: {missing}"

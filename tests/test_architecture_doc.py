"""docs/architecture.md's "What lives where" names every module, and every path it names exists.

A module is every ``.py`` file and every native source (``.c``, ``.cpp``, ``.h``) under ``obs/``, ``recorder/``,
``printsink/`` and ``exporters/``, except ``__init__.py``, ``__main__.py`` and vendored third-party code (a folder
that carries its own ``LICENSE*`` file, such as ``ryu/``).

The section is a table; a row's folder is the first path in its ``where`` cell (``obs/features/dump/stats/``, or
the folder of a file, ``obs/_core/`` for ``obs/_core/errors.py``).  A module counts as named when a row names it in
backticks, in either cell, by its path from the repository's root (``obs/_core/hooks.py``: a name with a ``/`` that
starts with a package's folder) or by its path from that row's folder (``tensor_stats.py`` in the
``obs/features/dump/stats/`` row, ``_inherit/sitecustomize.py`` in the ``obs/cli/`` row); a ``.py`` module may leave
its suffix off (``layout`` in a ``recorder/`` row).  docs/contributing.md states the same rule.

Every backticked name in the section that is a path (it holds a ``/`` or ends in one of those suffixes) is read
the same way, and must exist.  Only files are read; nothing is imported.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("obs", "recorder", "printsink", "exporters")
SUFFIXES = (".py", ".c", ".cpp", ".h")
NOT_MODULES = ("__init__.py", "__main__.py")
_BACKTICKED = re.compile(r"`([^`]+)`")


def _vendored(path: pathlib.Path) -> bool:
    return any(any(folder.glob("LICENSE*")) for folder in path.parents if ROOT in folder.parents)


def _modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.suffix in SUFFIXES and path.name not in NOT_MODULES and not _vendored(path):
                found.append(path.relative_to(ROOT).as_posix())
    return sorted(found)


def _rows(doc: str) -> list[list[str]]:
    """The section's table rows, each as its cells (the header and the rule left out)."""
    found = re.search(r"^## What lives where\n(.*?)(?=^## |\Z)", doc, re.MULTILINE | re.DOTALL)
    assert found, "docs/architecture.md has no '## What lives where' section"
    section = found.group(1)
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith(("| where |", "|---")):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _is_path(name: str) -> bool:
    return "/" in name or name.endswith(SUFFIXES)


def _resolve(name: str, folder: str) -> str:
    """``name`` from the root when it starts with a package's folder (``recorder/ring.py``), else from the row's
    ``folder`` (``recorder``, in the ``recorder/`` row, is ``recorder/recorder.py``)."""
    return name if "/" in name and name.split("/", 1)[0] in PACKAGES else folder + name


def _named(rows: list[list[str]]) -> tuple[set[str], list[str]]:
    """The paths the rows name (``.py`` modules also without their suffix), and each named path with its row's
    folder, to check that it exists."""
    names: set[str] = set()
    paths: list[str] = []
    for where, *what in rows:
        first = next(name for name in _BACKTICKED.findall(where) if _is_path(name))
        folder = first if first.endswith("/") else first.rpartition("/")[0] + "/"
        for name in _BACKTICKED.findall(" ".join([where, *what])):
            path = _resolve(name, folder)
            names.add(path)
            if _is_path(name):
                paths.append(path)
    return names, paths


def _unnamed(modules: list[str], names: set[str]) -> list[str]:
    return [m for m in modules if m not in names and not (m.endswith(".py") and m.removesuffix(".py") in names)]


def test_every_module_is_named_in_what_lives_where():
    names, _ = _named(_rows(DOC.read_text()))
    assert _unnamed(_modules(), names) == []


def test_every_path_named_in_what_lives_where_exists():
    _, paths = _named(_rows(DOC.read_text()))
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_rule_reads_full_paths_names_in_a_folders_row_and_bare_stems():
    doc = "\n".join([
        "## What lives where", "| where | what |", "|---|---|",
        "| `obs/_core/errors.py`, `internal.py` | errors |",
        "| `recorder/` | the ring (`layout`, `_hotpath.c`), `sub/x.py` |",
        "| `obs/features/x/` | `a.py`, and `recorder/ring.py` named from the root |",
        "## Native code", "| `obs/never.py` | after the section |",
    ])
    names, paths = _named(_rows(doc))
    modules = ["obs/_core/errors.py", "obs/_core/internal.py", "recorder/layout.py", "recorder/_hotpath.c",
               "recorder/sub/x.py", "obs/features/x/a.py", "recorder/ring.py", "obs/never.py", "recorder/layout.c"]
    assert _unnamed(modules, names) == ["obs/never.py", "recorder/layout.c"]
    assert "recorder/layout" not in paths and "obs/features/x/a.py" in paths

"""The layers of docs/architecture.md hold: no import goes up, and no module imports itself through others.

Read from the source (every ``import`` statement, inside functions too, package ``__init__`` files
included; only ``if TYPE_CHECKING:`` blocks are left out): a lazy import up is still a dependency up.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("obs", "recorder", "printsink", "exporters")

#: Bottom to top; a module belongs to the longest prefix that names it.
LAYERS = (
    ("obs._core",),
    ("recorder", "printsink"),
    ("exporters",),
    ("obs.settings",),
    ("obs.runtime",),
    ("obs.features",),
    ("obs",),
    ("obs.cli", "obs.__main__"),
)

#: Libraries that must not import each other (exporters, one layer up, read the ring through the recorder).
LIBRARIES = ("recorder", "printsink")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _known(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> Iterator[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(node) for branch in ast.walk(tree)
               if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
               for statement in branch.body for node in ast.walk(statement)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules)
                if target:
                    yield target, node.lineno


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in _imports(module, path, modules):
            if target != module:
                edges.setdefault(target, line)
    return graph


def _layer(module: str) -> tuple[int, str]:
    best = (-1, "")
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (index, prefix)
    return best


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_belongs_to_a_layer():
    assert [m for m in _graph() if _layer(m)[0] < 0] == []


def test_no_import_goes_up_or_sideways_between_libraries():
    wrong = []
    for module, edges in _graph().items():
        (low, low_name) = _layer(module)
        for target, line in edges.items():
            (high, high_name) = _layer(target)
            if high > low:
                wrong.append(f"{module}:{line} imports {target} ({low_name} -> {high_name}, up)")
            elif low_name != high_name and {low_name, high_name} <= set(LIBRARIES):
                wrong.append(f"{module}:{line} imports {target} ({low_name} -> {high_name}, sideways)")
    assert wrong == []


def test_no_module_imports_itself_through_others():
    assert _circles(_graph()) == []


def test_the_check_sees_a_circle_and_an_import_up():
    graph = {"obs._core.a": {"obs.cli.x": 1}, "obs.cli.x": {"obs._core.a": 2}}
    assert _circles(graph) == [["obs._core.a", "obs.cli.x"]]
    assert _layer("obs.cli.x")[0] > _layer("obs._core.a")[0]
    assert _layer("obs.features.dump.reader") == (5, "obs.features")


def test_features_use_the_adapters_public_names_not_its_underscore_modules():
    """``obs.runtime.torch`` names what features use of it; its underscore modules are its own.  Type-only imports
    and module names looked up in ``sys.modules`` count too."""
    private = re.compile(r"obs\.runtime\.torch\._\w+")
    found = []
    for path in sorted((ROOT / "obs").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if _layer(module)[1] == "obs.runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "obs.runtime.torch" else []
                names.append(node.module or "")
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            else:
                continue
            found += [f"{module}:{node.lineno} {n}" for n in names if private.fullmatch(n)]
    assert found == []

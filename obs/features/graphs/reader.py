"""Read an ``.ir`` file back into an :class:`~obs.features.graphs.model.IrFile` (used by ``obs graph`` and the tests).

Pure: text in, dataclasses out.  A file that does not start with ``# IR entry: @`` is
:class:`NotOurFileError`; one that starts so but breaks the grammar, ends early or whose counts
disagree with its body is :class:`DamagedFileError` naming the line and byte offset.  Lines of
MindSpore's richer files that we do not model (``cnode_attrs``, kernel type lines, ``# Order``)
are skipped.
"""

from __future__ import annotations

import re

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError
from obs.features.graphs.model import Abstract, Graph, IrFile, Node, Param, closing, parse_abstract, split_top

__all__ = ["MAX_IR_BYTES", "parse_ir", "read_graph_file", "read_ir"]

#: the largest graph file read (a 10 000-node graph is about 5 MB)
MAX_IR_BYTES = 1 << 30

_NODE = re.compile(r"^  %(\d+)\(([^)]*)\) = ([^(]+)\(")
_PARAM = re.compile(r"^(%para(\d+)_(\S+?)): (.*?)(  :  has_default)?$")
_FRAME = re.compile(r"^      # In file (.*)$")
_SCOPE = re.compile(r"^      # Fullname with scope: \((.*)\)$")
_HEAD = "# IR entry: @"


class _Lines:
    def __init__(self, text: str, path: str) -> None:
        self.lines = text.split("\n")
        self.offsets = []
        at = 0
        for line in self.lines:
            self.offsets.append(at)
            at += len(line.encode("utf-8", "surrogateescape")) + 1
        self.i = 0
        self.path = path

    def peek(self) -> str | None:
        return self.lines[self.i] if self.i < len(self.lines) else None

    def take(self) -> str:
        line = self.peek()
        if line is None:
            raise self.damaged("the file ends early")
        self.i += 1
        return line

    def damaged(self, what: str, line: int | None = None) -> DamagedFileError:
        i = self.i if line is None else line
        offset = self.offsets[i] if i < len(self.offsets) else self.offsets[-1] + len(self.lines[-1])
        return DamagedFileError(f"{self.path}: damaged .ir file at line {i + 1} (byte {offset}): {what}",
                                path=self.path, offset=offset)

    def expect(self, prefix: str) -> str:
        line = self.take()
        if not line.startswith(prefix):
            raise self.damaged(f"expected {prefix.strip()!r}, found {line[:60]!r}", self.i - 1)
        return line[len(prefix):]

    def skip_blank(self) -> None:
        while self.peek() == "":
            self.i += 1


def _int(lines: _Lines, text: str, what: str) -> int:
    if not re.fullmatch(r"\d{1,9}", text.strip()):
        raise lines.damaged(f"{what} must be a number, not {text.strip()[:40]!r}", lines.i - 1)
    return int(text)


def _abstract(lines: _Lines, text: str) -> Abstract:
    try:
        return parse_abstract(text)
    except ValueError as exc:
        raise lines.damaged(f"bad type {text[:60]!r}: {exc}", lines.i - 1) from None


def _types(lines: _Lines, text: str) -> list[Abstract]:
    text = text.strip()
    if not (text.startswith("(") and text.endswith(")")):
        raise lines.damaged(f"types must be written (...), not {text[:60]!r}", lines.i - 1)
    try:
        parts = split_top(text[1:-1])
    except ValueError as exc:
        raise lines.damaged(f"{exc} in {text[:60]!r}", lines.i - 1) from None
    return [_abstract(lines, p) for p in parts]


def _attrs(lines: _Lines) -> dict[str, str]:
    out: dict[str, str] = {}
    while (line := lines.peek()) not in (None, "") and not line.startswith(("subgraph ", "# ")):
        key, sep, value = lines.take().partition(": ")
        if not sep:
            raise lines.damaged(f"an attribute is 'key: value', not {line[:60]!r}", lines.i - 1)
        out[key] = value
    return out


def parse_ir(text: str, path: str = "<ir>") -> IrFile:
    """The :class:`IrFile` of ``.ir`` text (see the module doc for errors)."""
    if not text.startswith(_HEAD):
        if _HEAD.startswith(text) and text:
            raise DamagedFileError(f"{path}: damaged .ir file at line 1 (byte {len(text.encode())}): the file ends "
                                   "early", path=path, offset=len(text.encode()))
        raise NotOurFileError(f"{path}: not an IR text file (expected {_HEAD.strip()!r} at byte 0)", path=path)
    lines = _Lines(text, path)
    entry = lines.expect(_HEAD).strip()
    if not entry:
        raise lines.damaged("the entry graph has no name", 0)
    total = _int(lines, lines.expect("# Total subgraphs: "), "the number of subgraphs")
    lines.skip_blank()
    attrs: dict[str, str] = {}
    if lines.peek() == "[jit config {" or (lines.peek() or "").startswith("jit config"):
        while lines.take() != "}":
            pass
        lines.skip_blank()
    if lines.peek() == "# Attrs:":
        lines.take()
        attrs = _attrs(lines)
        lines.skip_blank()
    n_params = _int(lines, lines.expect("# Total params: "), "the number of params")
    header_params: dict[str, Param] = {}
    if lines.peek() == "# Params:":
        lines.take()
        while (line := lines.peek()) is not None and line.startswith("%para"):
            lines.take()
            m = _PARAM.match(line)
            if m is None:
                raise lines.damaged(f"a param is '%paraN_name: <type>', not {line[:60]!r}", lines.i - 1)
            abstract_text = m.group(4).split("  :  ")[0]
            header_params[m.group(1)] = Param(int(m.group(2)), m.group(3), _abstract(lines, abstract_text),
                                              bool(m.group(5)) or "has_default" in m.group(4))
    if len(header_params) != n_params:
        raise lines.damaged(f"'# Total params: {n_params}' but {len(header_params)} params are listed")
    lines.skip_blank()
    lines.expect("Node counting information:")
    n_nodes = _int(lines, lines.expect("Total number of nodes: "), "the number of nodes")
    n_cnodes = _int(lines, lines.expect("Total number of cnodes: "), "the number of cnodes")
    graphs: list[Graph] = []
    while True:
        lines.skip_blank()
        line = lines.peek()
        if line is None:
            break
        if line.startswith("# Order:") or line.startswith("#   "):
            lines.take()
            continue
        graphs.append(_graph(lines, header_params))
    if len(graphs) != total:
        raise lines.damaged(f"'# Total subgraphs: {total}' but the file holds {len(graphs)}")
    cnodes = sum(len(g.nodes) + 1 for g in graphs)
    if cnodes != n_cnodes or cnodes + sum(len(g.params) for g in graphs) != n_nodes:
        raise lines.damaged(f"the counts ({n_nodes} nodes, {n_cnodes} cnodes) disagree with the body "
                            f"({cnodes + sum(len(g.params) for g in graphs)} nodes, {cnodes} cnodes)")
    if entry not in {g.name for g in graphs}:
        raise lines.damaged(f"the entry graph @{entry} is not in the file")
    return IrFile(entry, graphs, attrs, path)


def _graph(lines: _Lines, header_params: dict[str, Param]) -> Graph:
    if lines.peek() == "indirect: 1":
        lines.take()
    lines.expect("subgraph attr:")
    attrs = _attrs(lines)
    instance = lines.expect("subgraph instance: ")
    name = instance.rsplit(" : ", 1)[0]
    param_types: list[Abstract] = []
    frames: list[str] = []
    while (line := lines.peek()) is not None and line.startswith("# "):
        lines.take()
        if line.startswith("# Parameters: "):
            _, _, rest = line.partition(", ")
            param_types = _types(lines, rest)
        elif line.startswith("# In file "):
            frames.append(line[len("# In file "):])
    head = lines.expect(f"subgraph @{name}")
    m = re.match(r"^(?: parent: \[subgraph @[^\]]*\])?\((.*)\) \{$", head)
    if m is None:
        raise lines.damaged(f"expected 'subgraph @{name}(params) {{', found {head[:60]!r}", lines.i - 1)
    graph = Graph(name, attrs=attrs, frames=frames)
    refs = [r.strip() for r in m.group(1).split(",") if r.strip()]
    for k, ref in enumerate(refs):
        pm = re.fullmatch(r"%para(\d+)_(\S+)", ref)
        if pm is None:
            raise lines.damaged(f"a parameter is written %paraN_name, not {ref[:40]!r}", lines.i - 1)
        known = header_params.get(ref)
        if known is not None:
            graph.params.append(known)
        else:
            graph.params.append(Param(int(pm.group(1)), pm.group(2),
                                      param_types[k] if k < len(param_types) else Abstract("null")))
    while True:
        line = lines.take()
        if line == "}":
            return graph
        if line.startswith("  Return("):
            _return(lines, graph, line)
        elif line.startswith("  %"):
            graph.nodes.append(_node(lines, line))
        else:
            raise lines.damaged(f"expected a node line, Return or '}}', found {line[:60]!r}", lines.i - 1)


def _call(lines: _Lines, line: str, start: int) -> tuple[list[str], str]:
    """The arguments of the call whose '(' is at ``start``, and what follows it."""
    try:
        end = closing(line, start)
        return split_top(line[start + 1:end]), line[end + 1:]
    except ValueError as exc:
        raise lines.damaged(f"{exc} in {line[:80]!r}", lines.i - 1) from None


def _signature(lines: _Lines) -> tuple[list[Abstract], list[Abstract]]:
    text = lines.expect("      : ")
    if not text.startswith("("):
        raise lines.damaged(f"a type line is ': (inputs) -> (outputs)', not {text[:60]!r}", lines.i - 1)
    try:
        end = closing(text, 0)
    except ValueError as exc:
        raise lines.damaged(str(exc), lines.i - 1) from None
    inputs = _types(lines, text[:end + 1])
    rest = text[end + 1:]
    if not rest:
        return inputs, []
    if not rest.startswith(" -> "):
        raise lines.damaged(f"expected ' -> (outputs)' after the inputs, found {rest[:40]!r}", lines.i - 1)
    return inputs, _types(lines, rest[len(" -> "):])


def _tail(lines: _Lines) -> tuple[str, list[str]]:
    """The scope and frame comments after a node's type line (other comment and kernel lines skipped)."""
    scope, frames = "", []
    while (line := lines.peek()) is not None and line.startswith("      "):
        lines.take()
        if (m := _SCOPE.match(line)) is not None:
            scope = m.group(1)
        elif (m := _FRAME.match(line)) is not None:
            frames.append(m.group(1))
    return scope, frames


def _node(lines: _Lines, line: str) -> Node:
    m = _NODE.match(line)
    if m is None:
        raise lines.damaged(f"a node line is '%N(name) = op(args)', not {line[:60]!r}", lines.i - 1)
    args, rest = _call(lines, line, m.end() - 1)
    attrs: dict[str, str] = {}
    at = rest.find("primitive_attrs: {")
    if at >= 0:
        start = at + len("primitive_attrs: ")
        try:
            end = closing(rest, start)
            items = split_top(rest[start + 1:end])
        except ValueError as exc:
            raise lines.damaged(f"{exc} in primitive_attrs", lines.i - 1) from None
        for item in items:
            key, sep, value = item.partition(": ")
            if not sep:
                raise lines.damaged(f"an attribute is 'key: value', not {item[:40]!r}", lines.i - 1)
            attrs[key] = value
    inputs, outputs = _signature(lines)
    scope, frames = _tail(lines)
    return Node(int(m.group(1)), m.group(2), m.group(3).strip(), args, attrs, inputs, outputs, scope, frames)


def _return(lines: _Lines, graph: Graph, line: str) -> None:
    graph.returns, _ = _call(lines, line, len("  Return"))
    graph.return_types, _ = _signature(lines)
    graph.return_scope, _ = _tail(lines)


def read_graph_file(path: str) -> bytes:
    """The bytes of a graph file (opened without following a symlink); one larger than MAX_IR_BYTES is damaged."""
    data = safe_files.read_private(path, limit=MAX_IR_BYTES + 1, owned=False)
    if len(data) > MAX_IR_BYTES:
        raise DamagedFileError(f"{path}: larger than {MAX_IR_BYTES} bytes: not a graph obs wrote", path=path,
                               offset=MAX_IR_BYTES)
    return data


def read_ir(path: str) -> IrFile:
    """Read and parse ``path`` (opened without following a symlink; see :func:`parse_ir` for errors)."""
    data = read_graph_file(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not data.startswith(_HEAD.encode()):
            raise NotOurFileError(f"{path}: not an IR text file (not UTF-8 text)", path=path) from None
        raise DamagedFileError(f"{path}: damaged .ir file at byte {exc.start}: not UTF-8", path=path,
                               offset=exc.start) from None
    return parse_ir(text, path)

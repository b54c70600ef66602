"""What a graph file holds, as dataclasses: the writer's input and the reader's output are the same.

An :class:`IrFile` is a header (entry graph, attributes) and subgraphs; a :class:`Graph` has
parameters and nodes; every value's type is an :class:`Abstract` written in MindSpore's spelling
(``<Tensor[Float32], (2, 3)>``, ``<Ref[Tensor[Float32]], (3, 4), ref_key=fc1.weight, is_parameter>``,
``<Int64, NoShape>``, ``<Tuple[Tensor[Float32]*2], TupleShape((3, 4), (3))>``, ``<null>``).
Pure: no torch, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Abstract", "Graph", "IrFile", "Node", "Param", "closing", "format_abstract", "parse_abstract", "split_top"]

_DTYPE_BYTES = {"Bool": 1, "Int8": 1, "UInt8": 1, "Int16": 2, "UInt16": 2, "Float16": 2, "BFloat16": 2,
                "Int32": 4, "UInt32": 4, "Float32": 4, "Int64": 8, "UInt64": 8, "Float64": 8, "Complex64": 8,
                "Complex128": 16}


@dataclass(frozen=True)
class Abstract:
    """A value's type.  ``kind``: ``Tensor``, ``Ref`` (a parameter), ``Tuple``, a scalar type name
    (``Int64``, ``Float64``, ``Bool``...) or ``null`` (unknown).  ``shape`` is None for NoShape; a dim is an
    int or a symbol (``s0``).  ``extras``: ``key=value`` (or bare flags) after the shape, in order."""

    kind: str
    dtype: str = ""
    shape: tuple[int | str, ...] | None = None
    extras: tuple[str, ...] = ()
    elements: tuple[Abstract, ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.kind in ("Tensor", "Ref")

    def numel(self) -> int | None:
        """Elements of a tensor with a static shape, else None."""
        if not self.is_tensor or self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    def nbytes(self) -> int | None:
        n = self.numel()
        return None if n is None else n * _DTYPE_BYTES.get(self.dtype, 4)

    def extra(self, key: str) -> str | None:
        for item in self.extras:
            name, _, value = item.partition("=")
            if name == key:
                return value if value else "true"
        return None


@dataclass
class Param:
    """A graph input: ``%para{index}_{name}``; ``has_default`` for weights and buffers."""

    index: int
    name: str
    abstract: Abstract
    has_default: bool = False

    @property
    def ref(self) -> str:
        return f"%para{self.index}_{self.name}"


@dataclass
class Node:
    """One computation: ``%{index}({name}) = {op}({args}) primitive_attrs: {attrs}``."""

    index: int
    name: str
    op: str
    args: list[str] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)
    inputs: list[Abstract] = field(default_factory=list)
    outputs: list[Abstract] = field(default_factory=list)
    scope: str = ""
    frames: list[str] = field(default_factory=list)  #: ``path:line/source/``, outermost first

    @property
    def ref(self) -> str:
        return f"%{self.index}"


@dataclass
class Graph:
    """One subgraph: attributes, parameters, nodes and what it returns."""

    name: str
    params: list[Param] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    returns: list[str] = field(default_factory=list)
    return_types: list[Abstract] = field(default_factory=list)
    return_scope: str = "Default/Return-op0"
    attrs: dict[str, str] = field(default_factory=dict)
    frames: list[str] = field(default_factory=list)


@dataclass
class IrFile:
    """A whole ``.ir`` file: ``entry`` names the first graph; ``attrs`` are the header's ``# Attrs``."""

    entry: str
    graphs: list[Graph]
    attrs: dict[str, str] = field(default_factory=dict)
    path: str = ""

    @property
    def main(self) -> Graph:
        for graph in self.graphs:
            if graph.name == self.entry:
                return graph
        return self.graphs[0]


# -- abstracts ---------------------------------------------------------------------------------------
def _dims(shape: tuple[int | str, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def format_abstract(a: Abstract) -> str:
    """The abstract's text, e.g. ``<Tensor[Float32], (2, 3)>``."""
    if a.kind == "null":
        return "<null>"
    if a.kind == "Tuple":
        names = [_element_type(e) for e in a.elements]
        if names and all(n == names[0] for n in names) and len(names) > 1:
            type_text = f"{names[0]}*{len(names)}"
        else:
            type_text = ",".join(names)
        shapes = ", ".join(_dims(e.shape) if e.shape is not None else "NoShape" for e in a.elements)
        head = f"<Tuple[{type_text}], TupleShape({shapes})"
    else:
        head = f"<{_element_type(a)}, " + (_dims(a.shape) if a.shape is not None else "NoShape")
    return head + "".join(f", {x}" for x in a.extras) + ">"


def _element_type(a: Abstract) -> str:
    if a.kind == "Tensor":
        return f"Tensor[{a.dtype}]"
    if a.kind == "Ref":
        return f"Ref[Tensor[{a.dtype}]]"
    if a.kind == "Tuple":
        return "Tuple[" + ",".join(_element_type(e) for e in a.elements) + "]"
    return a.kind


_ELEMENT = re.compile(r"Ref\[Tensor\[([\w.]+)\]\]|Tensor\[([\w.]+)\]|([A-Za-z_][\w.]*)$")


def _parse_element(text: str) -> Abstract:
    m = _ELEMENT.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"unknown type {text.strip()!r}")
    if m.group(1):
        return Abstract("Ref", m.group(1))
    if m.group(2):
        return Abstract("Tensor", m.group(2))
    return Abstract(m.group(3))


def _parse_dims(text: str) -> tuple[int | str, ...] | None:
    text = text.strip()
    if text == "NoShape":
        return None
    if not (text.startswith("(") and text.endswith(")")):
        raise ValueError(f"a shape must be (d0, d1, ...) or NoShape, not {text!r}")
    inner = text[1:-1].strip()
    if not inner:
        return ()
    out: list[int | str] = []
    for part in inner.split(","):
        part = part.strip()
        if re.fullmatch(r"-?\d+", part):
            out.append(int(part))
        elif re.fullmatch(r"[A-Za-z_][\w*+\-/ ]*", part):
            out.append(part)
        else:
            raise ValueError(f"bad dimension {part!r} in {text!r}")
    return tuple(out)


def parse_abstract(text: str) -> Abstract:
    """The inverse of :func:`format_abstract`; raises ValueError saying what is wrong."""
    text = text.strip()
    if text == "<null>":
        return Abstract("null")
    if not (text.startswith("<") and text.endswith(">")):
        raise ValueError(f"an abstract is written <...>, not {text[:40]!r}")
    parts = split_top(text[1:-1])
    if len(parts) < 2:
        raise ValueError(f"an abstract needs a type and a shape: {text[:60]!r}")
    head, shape_text, extras = parts[0].strip(), parts[1].strip(), tuple(p.strip() for p in parts[2:])
    if head.startswith("Tuple[") and head.endswith("]"):
        inner = head[len("Tuple["):-1]
        star = re.fullmatch(r"(.+)\*(\d+)", inner)
        names = [star.group(1)] * int(star.group(2)) if star else split_top(inner) if inner else []
        if not (shape_text.startswith("TupleShape(") and shape_text.endswith(")")):
            raise ValueError(f"a tuple's shape is TupleShape(...), not {shape_text[:40]!r}")
        shapes = split_top(shape_text[len("TupleShape("):-1]) if shape_text != "TupleShape()" else []
        if len(shapes) != len(names):
            raise ValueError(f"tuple of {len(names)} types has {len(shapes)} shapes")
        elements = tuple(_with_shape(_parse_element(n), _parse_dims(s)) for n, s in zip(names, shapes))
        return Abstract("Tuple", elements=elements, extras=extras)
    element = _parse_element(head)
    return Abstract(element.kind, element.dtype, _parse_dims(shape_text), extras)


def _with_shape(a: Abstract, shape: tuple[int | str, ...] | None) -> Abstract:
    return Abstract(a.kind, a.dtype, shape, a.extras, a.elements)


_OPEN, _CLOSE = "([{<", ")]}>"


def closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]`` (quotes respected); ValueError if none."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "-" and text.startswith("->", i):
            i += 1  # an arrow is no bracket
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"no closing bracket for {text[start]!r} at character {start}")


def split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets and double-quoted strings (backslash escapes)."""
    out, depth, start, i, n = [], 0, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced {c!r} at character {i}")
        elif c == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
        i += 1
    if depth != 0:
        raise ValueError("unbalanced brackets")
    out.append(text[start:])
    return [p for p in (s.strip() for s in out)] if out != [""] else []

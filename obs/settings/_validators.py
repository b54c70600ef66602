"""Small composable validators: ``check(value, name) -> normalised value`` or a clear error.

Messages follow one template: ``'<name>' must be <expectation> (got <value!r>)``.  Type errors
raise :class:`ObsConfigTypeError` (a TypeError), everything else :class:`ObsConfigError`
(a ValueError).  ``describe()`` feeds ``obs options`` and the docs from the same object.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from obs._core.errors import ObsConfigError, ObsConfigTypeError

__all__ = [
    "Bool", "Choice", "Dict", "ExistingFile", "Int", "Mapped", "SaveGraphsLevel", "Size", "Str",
    "Validator", "did_you_mean", "fail", "json_words", "show", "type_fail",
]

_JSON_WORDS: contextvars.ContextVar[bool] = contextvars.ContextVar("obs_json_words", default=False)
_JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


@contextlib.contextmanager
def json_words() -> Iterator[None]:
    """Inside: messages show values as JSON writes them (``true``, ``null``, ``"x"``), for JSON files."""
    token = _JSON_WORDS.set(True)
    try:
        yield
    finally:
        _JSON_WORDS.reset(token)


def show(value: Any) -> str:
    """A value in a message: its ``repr`` (or its JSON form inside :func:`json_words`), cut to ~80 characters."""
    if _JSON_WORDS.get():
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = repr(value)
    else:
        text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}…[{len(text)} chars]"


def _type_word(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__) if _JSON_WORDS.get() else type(value).__name__


def fail(name: str, expectation: str, value: Any) -> ObsConfigError:
    return ObsConfigError(f"'{name}' must be {expectation} (got {show(value)})", option=name, value=value)


def type_fail(name: str, expectation: str, value: Any) -> ObsConfigTypeError:
    return ObsConfigTypeError(f"'{name}' must be {expectation} (got {show(value)} of type {_type_word(value)})",
                              option=name, value=value)


def did_you_mean(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(show(c) for c in close)}?" if close else ""


class Validator:
    """Base: subclasses implement ``__call__(value, name)`` and ``describe()``."""

    def __call__(self, value: Any, name: str) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Bool(Validator):
    def __call__(self, value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            raise type_fail(name, "true or false" if _JSON_WORDS.get() else "a bool (True or False)", value)
        return value

    def describe(self) -> str:
        return "bool"


@dataclass(frozen=True)
class Int(Validator):
    min: int | None = None
    max: int | None = None

    def __call__(self, value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise type_fail(name, "an int", value)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise fail(name, f"an int {self._range()}", value)
        return value

    def _range(self) -> str:
        if self.min is not None and self.max is not None:
            return f"in [{self.min}, {self.max}]"
        return f">= {self.min}" if self.min is not None else f"<= {self.max}"

    def describe(self) -> str:
        return f"int {self._range()}" if (self.min is not None or self.max is not None) else "int"


@dataclass(frozen=True)
class Str(Validator):
    non_empty: bool = False
    pattern: str | None = None
    expectation: str = ""

    def __call__(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise type_fail(name, "a str", value)
        if self.non_empty and not value:
            raise fail(name, "a non-empty string", value)
        if "\x00" in value:
            raise fail(name, "a string without NUL characters", value)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no file name, no log line can hold it
            raise fail(name, "valid Unicode text (no lone surrogates)", value) from None
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise fail(name, self.expectation or f"a string matching {self.pattern!r}", value)
        return value

    def describe(self) -> str:
        return self.expectation or ("non-empty str" if self.non_empty else "str")


@dataclass(frozen=True)
class Choice(Validator):
    """One of a fixed set; compared exactly (``"ON"`` is not ``"on"``)."""

    values: tuple[Any, ...]

    def __call__(self, value: Any, name: str) -> Any:
        types = {type(v) for v in self.values}
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, tuple(types)):
            raise type_fail(name, f"one of {show(list(self.values))}", value)
        if value not in self.values:
            hint = did_you_mean(value, [str(v) for v in self.values]) if isinstance(value, str) else ""
            raise ObsConfigError(f"'{name}' must be one of {show(list(self.values))} (got {show(value)}){hint}",
                                 option=name, value=value)
        return value

    def describe(self) -> str:
        return " | ".join(repr(v) for v in self.values)


@dataclass(frozen=True)
class Mapped(Validator):
    """An int constant with names, e.g. ``obs.GRAPH_MODE (0) | obs.PYNATIVE_MODE (1)``."""

    names: Mapping[int, str]

    def __call__(self, value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise type_fail(name, self.describe(), value)
        if value not in self.names:
            raise fail(name, self.describe(), value)
        return value

    def describe(self) -> str:
        return " | ".join(f"obs.{n} ({v})" for v, n in self.names.items())


_SIZE_RE = re.compile(r"(?:[1-9][0-9]*(?:\.[0-9]*)?|0\.[0-9]*)GB")


@dataclass(frozen=True)
class Size(Validator):
    """A size string like ``"3.5GB"`` (MindSpore's format), normalised to float GB."""

    min_gb: float = 0.0
    max_gb: float | None = None
    strictly_positive: bool = True

    def __call__(self, value: Any, name: str) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # A number of GB: what get_context returns (MindSpore stores float GB), accepted back.
            if not 0 <= value < float("inf"):
                raise fail(name, "a finite number of GB >= 0 or a size string like '3.5GB'", value)
            return self._bounded(float(value), name, value)
        if not isinstance(value, str):
            raise type_fail(name, "a size string like '3.5GB' (or a number of GB)", value)
        if not _SIZE_RE.fullmatch(value):
            raise fail(name, "a size string like '3.5GB' (digits, optional decimals, then 'GB')", value)
        return self._bounded(float(value[:-2]), name, value)

    def _bounded(self, gb: float, name: str, value: Any) -> float:
        if self.strictly_positive and gb == 0:
            raise fail(name, "a size greater than 0GB", value)
        if gb < self.min_gb or (self.max_gb is not None and gb > self.max_gb):
            upper = f" and at most {self.max_gb:g}GB" if self.max_gb is not None else ""
            raise fail(name, f"a size of at least {self.min_gb:g}GB{upper}", value)
        return gb

    def describe(self) -> str:
        return "size str like '3.5GB' | float GB"


@dataclass(frozen=True)
class SaveGraphsLevel(Validator):
    """bool or int 0-3; True means 2 and False 0, as in MindSpore."""

    def __call__(self, value: Any, name: str) -> int:
        if isinstance(value, bool):
            return 2 if value else 0
        if not isinstance(value, int):
            raise type_fail(name, "a bool or an int in [0, 3]", value)
        if not 0 <= value <= 3:
            raise fail(name, "a bool or an int in [0, 3]", value)
        return value

    def describe(self) -> str:
        return "bool | int 0-3"


@dataclass(frozen=True)
class ExistingFile(Validator):
    """Path of an existing regular file; normalised to its real path."""

    def __call__(self, value: Any, name: str) -> str:
        if not isinstance(value, (str, os.PathLike)):
            raise type_fail(name, "a path (str) of an existing file", value)
        path = os.fspath(value)
        if not path:
            raise fail(name, "a non-empty path of an existing file", value)
        real = os.path.realpath(os.path.expanduser(path))
        if not os.path.isfile(real):
            what = "a directory" if os.path.isdir(real) else "missing"
            raise fail(name, f"the path of an existing file ({real} is {what})", value)
        return real

    def describe(self) -> str:
        return "path of an existing file"


@dataclass(frozen=True)
class Dict(Validator):
    """A dict with a fixed set of keys, each with its own validator (and device scope).

    Keys not given keep no value; ``defaults`` are what ``get_context`` reports for them.
    """

    schema: Mapping[str, Validator]
    devices: Mapping[str, frozenset[str]] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise type_fail(name, f"a dict with keys from {sorted(self.schema)}", value)
        out: dict[str, Any] = {}
        for key, sub in value.items():
            if key not in self.schema:
                raise ObsConfigError(
                    f"'{name}' has no key {show(key)}{did_you_mean(str(key), tuple(self.schema))} "
                    f"(its keys are {sorted(self.schema)})", option=name, value=value)
            out[key] = self.schema[key](sub, f"{name}.{key}")
        return out

    def describe(self) -> str:
        return "dict: " + ", ".join(self.schema)


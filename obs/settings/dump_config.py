"""The data dump's JSON (MindSpore's ``MINDSPORE_DUMP_CONFIG`` format), validated by one declarative table.

Every field of ``common_dump_settings`` and ``e2e_dump_settings`` is a row: required or not, its
validator, its default.  All problems of a file are collected; each message names the field, the
expectation and the value.  Differences from MindSpore's dump, on purpose: a malformed iteration range
(``"1-"``, ``"2-0"``) is an error (MindSpore silently dumps nothing); unknown keys are errors
with a close match; ``saved_data`` statistic/full work on CPU; ``file_format`` must be ``npy``;
``dump_mode`` 2 (cells marked by ``set_dump``) is refused, as MindSpore does off Ascend.

:func:`parse_dump_config` gives a frozen :class:`DumpConfig` whose ``iterations`` and ``kernels``
are compiled once (no parsing per op).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from obs._core import env
from obs._core.errors import ObsConfigError, ObsConfigTypeError
from obs.settings._table import Option, OptionTable
from obs.settings._validators import (
    Bool,
    Choice,
    Int,
    Str,
    Validator,
    did_you_mean,
    fail,
    json_words,
    show,
    type_fail,
)

__all__ = ["CATEGORY_COLUMNS", "DumpConfig", "DumpConfigError", "ENV_VARS", "Iterations", "KernelFilter",
           "load_dump_config", "parse_dump_config"]

#: Variables naming the dump JSON file (MindSpore's first).
ENV_VARS = (env.MINDSPORE_DUMP_CONFIG, env.OBS_DUMP_CONFIG)

#: statistic_category item -> its statistic.csv column (MindSpore 2.10's spellings)
CATEGORY_COLUMNS: dict[str, str] = {
    "max": "Max Value", "min": "Min Value", "avg": "Avg Value", "count": "Count",
    "negative zero count": "Negative Zero Count", "positive zero count": "Positive Zero Count",
    "nan count": "NaN Count", "negative inf count": "Negative Inf Count",
    "positive inf count": "Positive Inf Count", "zero count": "Zero Count", "l2norm": "L2Norm Value",
    "md5": "MD5", "hash:md5": "MD5", "hash": "SHA1", "hash:sha1": "SHA1",
}


class DumpConfigError(ObsConfigError):
    """Everything wrong with one dump config at once (``problems``: ``(field, message)``)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        where = f"dump config {source}" if source else "dump config"
        if len(problems) == 1:
            message = f"{where}: {problems[0][1]}"
        else:
            message = f"{where} has {len(problems)} problems:" + "".join(f"\n  - {m}" for _, m in problems)
        super().__init__(message, option=problems[0][0], source=source)
        self.problems = problems


@dataclass(frozen=True)
class Iterations:
    """``"all"`` or inclusive ranges; ``iterations.match(n)``."""

    ranges: tuple[tuple[int, int], ...] | None  # None: all

    def __contains__(self, n: int) -> bool:
        if self.ranges is None:
            return True
        return any(lo <= n <= hi for lo, hi in self.ranges)

    @property
    def last(self) -> int | None:
        return None if self.ranges is None else max(hi for _, hi in self.ranges)


@dataclass(frozen=True)
class KernelFilter:
    """The ``kernels`` list compiled: full names (exact), op types (case-insensitive substring of the name's
    last part), ``name-regex(...)`` (searched in the full name).  Empty: everything."""

    exact: frozenset[str]
    types: tuple[str, ...]
    regexes: tuple[re.Pattern[str], ...]

    @property
    def everything(self) -> bool:
        return not (self.exact or self.types or self.regexes)

    def __call__(self, full_name: str) -> bool:
        if self.everything or full_name in self.exact:
            return True
        last = full_name.rsplit("/", 1)[-1].lower()
        return any(t in last for t in self.types) or any(r.search(full_name) for r in self.regexes)


@dataclass(frozen=True)
class DumpConfig:
    """A validated dump config; ``raw`` is the file's text (copied byte for byte to ``.dump_metadata``)."""

    dump_mode: int
    path: str
    net_name: str
    iteration: str
    iterations: Iterations
    saved_data: str
    input_output: int
    kernels: tuple[str, ...]
    kernel_filter: KernelFilter
    support_device: tuple[int, ...]
    op_debug_mode: int
    statistic_category: tuple[str, ...]
    file_format: str
    overflow_number: int
    initial_iteration: int
    e2e: Mapping[str, Any]
    raw: str = ""
    source: str = ""

    @property
    def tensors(self) -> bool:
        return self.saved_data in ("tensor", "full")

    @property
    def statistics(self) -> bool:
        return self.saved_data in ("statistic", "full")

    def wants(self, full_name: str) -> bool:
        return self.dump_mode == 0 or self.kernel_filter(full_name)


# -- validators of the fields the generic ones do not cover ----------------------------------------
_ITER_TOKEN = re.compile(r"(\d+)(?:-(\d+))?")


class _Iteration(Validator):
    def __call__(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise type_fail(name, 'a string: "all" or iterations like "0|5-8|100-120"', value)
        if value == "all":
            return value
        for token in value.split("|"):
            m = _ITER_TOKEN.fullmatch(token)
            if m is None:
                raise fail(name, f'"all" or iterations separated by "|", each N or LOW-HIGH with no spaces '
                                 f'(the part {show(token)} is neither)', value)
            if m.group(2) is not None and int(m.group(2)) < int(m.group(1)):
                raise fail(name, f"ranges LOW-HIGH with LOW <= HIGH (the part {show(token)} is reversed)", value)
        return value

    def describe(self) -> str:
        return '"all" | "0|5-8|100-120"'


class _Path(Validator):
    def __call__(self, value: Any, name: str) -> str:
        value = Str(non_empty=True)(value, name)
        if not value.startswith("/"):
            raise fail(name, "an absolute path (starting with '/')", value)
        if not re.fullmatch(r"[A-Za-z0-9_/-]+", value):
            raise fail(name, "a path of letters, digits, '-', '_' and '/' only (as MindSpore's dump accepts)", value)
        if any(part == ".." for part in value.split("/")):
            raise fail(name, "a path without '..'", value)
        return value

    def describe(self) -> str:
        return "absolute path [A-Za-z0-9-_/]"


class _StrList(Validator):
    def __init__(self, item: Validator | None = None) -> None:
        self.item = item

    def __call__(self, value: Any, name: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise type_fail(name, "an array", value)
        return tuple(self.item(v, f"{name}[{i}]") if self.item else v for i, v in enumerate(value))

    def describe(self) -> str:
        return "array"


class _Kernel(Validator):
    def __call__(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise type_fail(name, 'a kernel name, op type or "name-regex(...)"', value)
        if value.startswith("name-regex(") and value.endswith(")"):
            try:
                re.compile(value[len("name-regex("):-1])
            except re.error as exc:
                raise fail(name, f"a valid regular expression inside name-regex() ({exc})", value) from None
        elif not value:
            raise fail(name, "a non-empty kernel name", value)
        return value

    def describe(self) -> str:
        return "kernel name | op type | name-regex(...)"


class _Category(Validator):
    def __call__(self, value: Any, name: str) -> str:
        if not isinstance(value, str) or value not in CATEGORY_COLUMNS:
            hint = did_you_mean(value, tuple(CATEGORY_COLUMNS)) if isinstance(value, str) else ""
            raise ObsConfigError(f"'{name}' must be one of {show(list(CATEGORY_COLUMNS))} (got {show(value)})"
                                 f"{hint}", option=name, value=value)
        return value

    def describe(self) -> str:
        return "statistic name"


_UINT = Int(min=0)
COMMON = OptionTable("common_dump_settings", [
    Option("dump_mode", Choice((0, 1, 2)), None, "0 every op, 1 only `kernels`, 2 cells marked by set_dump",
           required=True),
    Option("path", _Path(), "", "absolute output folder (else $MS_DIAGNOSTIC_DATA_PATH/debug_dump)"),
    Option("net_name", Str(non_empty=True, pattern=r"[A-Za-z0-9_-]+", expectation="letters, digits, '-' and '_'"),
           None, "name of the net's folder", required=True),
    Option("iteration", _Iteration(), None, '"all" or "0|5-8|100-120"', required=True),
    Option("saved_data", Choice(("statistic", "tensor", "full")), "tensor", "statistic, tensor or both (full)"),
    Option("input_output", Choice((0, 1, 2)), None, "0 inputs and outputs, 1 inputs, 2 outputs", required=True),
    Option("kernels", _StrList(_Kernel()), None, "kernel names, op types, name-regex(...)", required=True),
    Option("support_device", _StrList(Int(min=0, max=4095)), None, "device ids (kept, not used on CPU/GPU)",
           required=True),
    Option("op_debug_mode", Choice((0, 1, 2, 3, 4)), 0, "0 normal, 3 overflow (NaN/Inf) only, 4 exception "
           "(inputs of a failing op); 1 and 2 mean 3"),
    Option("statistic_category", _StrList(_Category()), ("max", "min", "l2norm"),
           "statistics in statistic.csv, in this order"),
    Option("file_format", Choice(("npy",)), "npy", "npy (bin is Ascend-only)"),
    Option("overflow_number", _UINT, 0, "with op_debug_mode 3: stop after this many (0 = all)"),
    Option("initial_iteration", _UINT, 0, "number of the first iteration"),
])
E2E = OptionTable("e2e_dump_settings", [
    Option("enable", Bool(), True, "dump on"),
    Option("trans_flag", Bool(), True, "device format to host format"),
    Option("stat_calc_mode", Choice(("host", "device")), "host", "where statistics are computed"),
    Option("device_stat_precision_mode", Choice(("high", "low")), "high", "precision of device statistics"),
    Option("sample_mode", Choice((0, 1)), 0, "0 whole tensors, 1 samples"),
    Option("sample_num", Int(min=1), 100, "elements sampled"),
    Option("save_kernel_args", Bool(), False, "write each op's arguments as JSON"),
])
TOP: dict[str, OptionTable] = {"common_dump_settings": COMMON, "e2e_dump_settings": E2E}


def _section(name: str, body: Any, rows: OptionTable, problems: list[tuple[str, str]]) -> dict[str, Any]:
    if not isinstance(body, dict):
        problems.append((name, f"'{name}' must be a JSON object (got {show(body)})"))
        return {}
    out: dict[str, Any] = {}
    for key, value in body.items():
        full = f"{name}.{key}"
        if key not in rows:
            problems.append((full, f"'{name}' has no key {show(key)}{did_you_mean(key, tuple(rows))} "
                                   f"(its keys are {show(list(rows))})"))
            continue
        try:
            out[key] = rows[key].check(value, full)
        except (ObsConfigError, ObsConfigTypeError) as exc:
            problems.append((full, str(exc)))
    for key, row in rows.items():
        if key not in out and key not in body:
            if row.required:
                problems.append((f"{name}.{key}", f"'{name}.{key}' is required ({row.doc})"))
            else:
                out[key] = row.default
    return out


def _cross_checks(common: dict[str, Any], environ: Mapping[str, str], problems: list[tuple[str, str]]) -> None:
    if common.get("dump_mode") == 2:
        problems.append(("common_dump_settings.dump_mode", "'common_dump_settings.dump_mode' 2 (cells marked by "
                         "set_dump) is only supported by Ascend's async dump; use 0 (every op) or 1 (kernels)"))
    if common.get("overflow_number") and common.get("op_debug_mode") not in (1, 2, 3):
        problems.append(("common_dump_settings.overflow_number", "'common_dump_settings.overflow_number' may only "
                         f"be set with op_debug_mode 3 (got op_debug_mode {show(common.get('op_debug_mode'))})"))
    if "path" in common and not common["path"]:
        base = env.text(env.MS_DIAGNOSTIC_DATA_PATH, environ=environ)
        if not base:
            problems.append(("common_dump_settings.path", "'common_dump_settings.path' is not set and neither is "
                             "$MS_DIAGNOSTIC_DATA_PATH: say where the dump goes"))
        else:
            common["path"] = os.path.join(base, "debug_dump")


def _compile_kernels(kernels: tuple[str, ...]) -> KernelFilter:
    exact, types, regexes = set(), [], []
    for k in kernels:
        if k.startswith("name-regex(") and k.endswith(")"):
            regexes.append(re.compile(k[len("name-regex("):-1]))
        elif "/" in k or re.search(r"-op\d+$", k):
            exact.add(k)
        else:
            types.append(k.lower())
    return KernelFilter(frozenset(exact), tuple(types), tuple(regexes))


def parse_dump_config(data: Any, *, source: str = "", raw: str = "",
                      environ: Mapping[str, str] | None = None) -> DumpConfig:
    """Validate the decoded JSON ``data``; every problem is reported in one :class:`DumpConfigError`."""
    problems: list[tuple[str, str]] = []
    environ = os.environ if environ is None else environ
    with json_words():
        if not isinstance(data, dict):
            raise DumpConfigError(source, [("", f"must hold a JSON object with 'common_dump_settings' "
                                                f"(got {show(data)})")])
        for key in data:
            if key not in TOP:
                problems.append((key, f"unknown key {show(key)}{did_you_mean(key, tuple(TOP))} (the keys are "
                                      f"{show(list(TOP))})"))
        if "common_dump_settings" not in data:
            problems.append(("common_dump_settings", "'common_dump_settings' is required"))
        common = _section("common_dump_settings", data.get("common_dump_settings", {}), COMMON,
                          problems if "common_dump_settings" in data else [])
        e2e = _section("e2e_dump_settings", data.get("e2e_dump_settings", {}), E2E, problems)
        _cross_checks(common, environ, problems)
    if problems:
        raise DumpConfigError(source, problems)
    debug = 3 if common["op_debug_mode"] in (1, 2) else common["op_debug_mode"]
    iteration = common["iteration"]
    ranges = None if iteration == "all" else tuple(
        (int(m.group(1)), int(m.group(2) or m.group(1)))
        for m in (_ITER_TOKEN.fullmatch(t) for t in iteration.split("|")) if m)
    return DumpConfig(
        dump_mode=common["dump_mode"], path=common["path"], net_name=common["net_name"], iteration=iteration,
        iterations=Iterations(ranges), saved_data=common["saved_data"], input_output=common["input_output"],
        kernels=tuple(common["kernels"]), kernel_filter=_compile_kernels(tuple(common["kernels"])),
        support_device=tuple(common["support_device"]), op_debug_mode=debug,
        statistic_category=tuple(common["statistic_category"]), file_format=common["file_format"],
        overflow_number=common["overflow_number"], initial_iteration=common["initial_iteration"],
        e2e=dict(e2e), raw=raw, source=source)


def load_dump_config(path: str, *, environ: Mapping[str, str] | None = None) -> DumpConfig:
    """Read and validate a dump JSON file; a missing or unreadable file is a :class:`DumpConfigError` too."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise DumpConfigError(path, [("", "does not exist")]) from None
    except IsADirectoryError:
        raise DumpConfigError(path, [("", "is a directory, not a JSON file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DumpConfigError(path, [("", f"cannot be read ({exc})")]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DumpConfigError(path, [("", f"is not valid JSON: {exc.msg} at line {exc.lineno} column "
                                          f"{exc.colno} (byte offset {exc.pos})")]) from None
    except RecursionError:
        raise DumpConfigError(path, [("", "is nested too deeply to be a dump config")]) from None
    return parse_dump_config(data, source=path, raw=text, environ=environ)


class JsonObject(Validator):
    """Any JSON object (checked as a whole by a section check)."""

    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise type_fail(name, "a JSON object", value)
        return value

    def describe(self) -> str:
        return "object"


def check_dump_section(values: Mapping[str, Any]) -> str:
    """The env config file's ``dump`` section, checked as a dump config: "" when fine, else the problems."""
    if not values.get("common_dump_settings") and not values.get("e2e_dump_settings"):
        return ""
    body = {k: v for k, v in values.items() if v}
    try:
        parse_dump_config(body, source="section 'dump'")
    except DumpConfigError as exc:
        return str(exc)
    return ""


def is_dump_config(path: str) -> bool:
    """Whether ``path`` holds a dump config (a JSON object with ``common_dump_settings`` at the top), not an env
    config file; False for anything unreadable (the env config checker then says why)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.read(1 << 24))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "common_dump_settings" in data


def describe_dump(cfg: DumpConfig) -> list[str]:
    """Plain sentences saying what a dump config does."""
    what = {"statistic": "statistics (statistic.csv)", "tensor": "tensors (.npy)", "full": "tensors and statistics"}
    io = {0: "inputs and outputs", 1: "inputs", 2: "outputs"}[cfg.input_output]
    ops = "every op" if cfg.dump_mode == 0 or cfg.kernel_filter.everything else \
        f"the ops in kernels {list(cfg.kernels)}"
    if cfg.op_debug_mode == 3:
        return [f"NaN/Inf check (op_debug_mode 3): the first op output holding NaN/Inf is dumped under "
                f"{cfg.path}/rank_<r>/nan_check/"]
    if cfg.op_debug_mode == 4:
        return [f"exception dump (op_debug_mode 4): the inputs of a failing op or module go to "
                f"{cfg.path}/rank_<r>/exception_dump/"]
    lines = [f"data dump of {what[cfg.saved_data]}: {io} of {ops}, iterations {cfg.iteration}, into "
             f"{cfg.path}/rank_<r>/{cfg.net_name}/0/<iteration>/"]
    if cfg.statistics:
        lines.append("statistics: " + ", ".join(cfg.statistic_category))
    return lines

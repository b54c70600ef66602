"""``env_config_path``: the JSON file of the rdr/profiler/sys/... sections, its environment variables and precedence.

Sections are option tables like ``set_context``'s; later features add sections and rows here.
Precedence (one function, :func:`resolve`): defaults < ``MS_RDR_*`` environment < the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from obs._core import env
from obs._core.errors import ObsConfigError, ObsConfigTypeError
from obs.settings._table import Option, OptionTable
from obs.settings._validators import (
    Bool,
    Choice,
    Dict,
    Int,
    SaveGraphsLevel,
    Str,
    did_you_mean,
    json_words,
    show,
)
from obs.settings.dump_config import JsonObject, check_dump_section
from obs.settings.monitor_options import MONITOR_OPTIONS, check_monitor_section
from obs.settings.profiler_options import METRICS_OPTIONS, Endpoint, Levels, Steps, Window
from recorder.layout import DEFAULT_CAPACITY, check_capacity

__all__ = ["ENV_VARS", "SECTIONS", "ConfigFileError", "EnvConfig", "Problem", "load_file", "parse_env", "parse_text",
           "resolve"]

_RING_DEFAULTS = DEFAULT_CAPACITY  # slots per ring of the recorder

_ABS = Str(non_empty=True, pattern=r"/.*", expectation="an absolute path (starting with '/')")

SECTIONS: dict[str, OptionTable] = {
    "rdr": OptionTable("rdr", [
        Option("enable", Bool(), False, "Turn the Running Data Recorder on."),
        Option("mode", Choice((1, 2)), 1, "1: dump on faults only; 2: also at normal end."),
        Option("path", _ABS, "", "Absolute folder of RDR output (empty: the working directory)."),
        Option("granularity", Choice(("off", "step", "module", "op")), "module",
               "What the recorder keeps between faults: off (faults, prints, settings only), step (+ steps, memory, "
               "collectives), module (+ module enter/exit), op (+ every aten op: slow, for debugging)."),
        Option("capacity", Dict({name: Int(min=16, max=1 << 24) for name in _RING_DEFAULTS}, defaults=_RING_DEFAULTS),
               {}, "Slots per ring, e.g. {\"op\": 262144}; unset rings keep their defaults "
               + ", ".join(f"{k}={v}" for k, v in _RING_DEFAULTS.items()) + "."),
        Option("hang_action", Choice(("dump", "abort")), "dump",
               "On a hang (op_timeout seconds without progress): dump and keep running, or dump and abort."),
        Option("memory_history", Int(min=0, max=100_000), 0,
               "CUDA only: keep the allocator's newest N events (allocations and frees with their Python stacks) and "
               "put them in a CUDA out of memory's bundle as memory_snapshot.json; 0: off. A few µs per allocation."),
    ]),
    "profiler": OptionTable("profiler", [
        Option("enable", Bool(), False, "Turn the profiler on (as set_context(enable_profiling=True)): step, phase, "
               "module and op spans, built and sent by an exporter process."),
        Option("options", Levels(), "training_trace", "Levels joined by ':': training_trace (step and phase spans), "
               "task_trace (+ module spans under forward), op_trace (+ the most expensive ops)."),
        Option("output", _ABS, "", "Absolute folder of the local trace files (empty: ./obs_profile)."),
        Option("endpoint", Endpoint(), "", "OTLP collector URL (empty: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; with "
               "neither, {output}/rank_{r}/traces.otlp.jsonl and trace.json)."),
        Option("protocol", Choice(("", "grpc", "http/protobuf")), "", "OTLP protocol (empty: "
               "OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else http/protobuf)."),
        Option("steps", Steps(), "", "Steps to trace: \"0-100|200\", \"500-\", N (every N-th step) or \"\" (all)."),
        Option("span_budget", Int(min=5, max=10000), 50, "At most this many spans per step; the rest is aggregated "
               "into its parent's attributes (counts and total times), never dropped silently."),
        Option("module_depth", Int(min=1, max=64), 3, "task_trace: module spans down to this depth (1: root "
               "modules)."),
        Option("max_file_mb", Int(min=1, max=1 << 20), 100, "Local trace files are rotated at this size (MiB); "
               "the 5 newest rotated files are kept."),
        Option("window", Window(), {}, "A capture window: detail for steps start..start+steps-1 only, "
               "{\"start\": 20, \"steps\": 5, \"level\": \"task_trace\"} (level: task_trace, modules; op_trace, "
               "modules and ops); {}: none. Hot-reloaded without restarting the session."),
        *METRICS_OPTIONS,
    ]),
    "sys": OptionTable("sys", [
        Option("mem_reuse", Bool(), True, "Reuse device memory between ops."),
    ]),
    "exception_dump": OptionTable("exception_dump", [
        Option("enable", Bool(), False, "Save the inputs (and outputs) of the op or module that raises."),
        Option("mode", Choice(("1", "2")), "2", "'1' inputs and outputs, '2' inputs only (as ascend_config's "
               "exception_dump)."),
        Option("path", _ABS, "", "Absolute folder (empty: the RDR path when the RDR is on, else the working "
               "directory); dumps go to {path}/rank_{r}/exception_dump/."),
    ]),
    "nan_check": OptionTable("nan_check", [
        Option("enable", Bool(), False, "Find the first module (or op) whose output or gradient holds NaN/Inf."),
        Option("action", Choice(("continue", "raise")), "continue", "After recording and dumping the first "
               "NaN/Inf: keep training, or raise FloatingPointError."),
        Option("granularity", Choice(("module", "op")), "module", "Check module outputs (cheap) or every aten op."),
        Option("backward", Bool(), True, "Check gradients in backward too."),
        Option("path", _ABS, "", "Absolute folder of the dumps (empty: as exception_dump); they go to "
               "{path}/rank_{r}/nan_check/."),
        Option("sync", Bool(), False, "On CUDA, check each tensor as it is made (a host sync each: exact counts, "
               "inputs kept); off: flags read once per step, off the training thread."),
    ]),
    "dump": OptionTable("dump", [
        Option("common_dump_settings", JsonObject(), {}, "The data dump's settings, as in MINDSPORE_DUMP_CONFIG's "
               "JSON (dump_mode, path, net_name, iteration, saved_data, input_output, kernels, ...)."),
        Option("e2e_dump_settings", JsonObject(), {}, "The data dump's e2e_dump_settings (enable, trans_flag, ...)."),
    ]),
    "graphs": OptionTable("graphs", [
        Option("save_graphs", SaveGraphsLevel(), 0, "Graph/IR dump level 0-3 (as set_context's save_graphs, which "
               "wins when set); a reload applies to graphs compiled after it."),
        Option("save_graphs_path", _ABS, "", "Absolute folder of graph dumps (empty: save_graphs_path, else "
               "MS_DEV_SAVE_GRAPHS_PATH, else the working directory)."),
    ]),
    "monitor": MONITOR_OPTIONS,
}

#: Spellings accepted for a key (MindSpore's docs spell ``mem_reuse`` as ``mem_Reuse``).
ALIASES: dict[tuple[str, str], str] = {("sys", "mem_Reuse"): "mem_reuse"}

#: Environment variables read before the file: name -> (section, key, parser).
ENV_VARS: dict[str, tuple[str, str]] = {
    env.MS_RDR_ENABLE: ("rdr", "enable"),
    env.MS_RDR_MODE: ("rdr", "mode"),
    env.MS_RDR_PATH: ("rdr", "path"),
}


@dataclass(frozen=True)
class EnvConfig:
    """Settings in force: ``values[section][key]`` and where each came from (default, env var, file)."""

    values: Mapping[str, Mapping[str, Any]]
    origins: Mapping[str, Mapping[str, str]]
    file: str = ""

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {section: dict(keys) for section, keys in self.values.items()}


@dataclass(frozen=True)
class ParsedFile:
    path: str
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a file: the key (``section.key``, or ``""`` for the file as a whole) and why."""

    key: str
    message: str
    value: Any = None


class ConfigFileError(ObsConfigError):
    """Everything wrong with one env config file at once (``problems``); the message lists them all."""

    def __init__(self, path: str, problems: list[Problem]) -> None:
        if len(problems) == 1:
            message = f"env config file {path}: {problems[0].message}"
        else:
            message = f"env config file {path} has {len(problems)} problems:" + "".join(
                f"\n  - {p.message}" for p in problems)
        first = problems[0]
        super().__init__(message, option=first.key, value=first.value, source=path)
        self.path = path
        self.problems = problems


def _err(path: str, message: str, key: str = "", value: Any = None) -> ConfigFileError:
    return ConfigFileError(path, [Problem(key, message, value)])


def _no_duplicates(found: list[str]):  # noqa: ANN202 - a json object_pairs_hook
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                found.append(key)
            out[key] = value
        return out

    return hook


def parse_text(text: str, path: str) -> ParsedFile:
    """Validate a file's text as a whole; every problem found is reported in one :class:`ConfigFileError`."""
    duplicates: list[str] = []
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates(duplicates))
    except json.JSONDecodeError as exc:
        raise _err(path, f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
                         f"(byte offset {exc.pos})") from None
    except RecursionError:
        raise _err(path, "is nested too deeply to be an env config file (it holds sections of plain keys)") from None
    if not isinstance(data, dict):
        raise _err(path, f"must hold a JSON object of sections {show_json(sorted(SECTIONS))} "
                         f"(got a JSON {_json_type(data)})")
    problems = [Problem(key, f"key {show_json(key)} is given more than once (JSON objects need unique keys; "
                             "which one should win is ambiguous)", key) for key in dict.fromkeys(duplicates)]
    out: dict[str, dict[str, Any]] = {}
    with json_words():
        for name, body in data.items():
            if name not in SECTIONS:
                problems.append(Problem(name, f"unknown section {show(name)}{did_you_mean(name, tuple(SECTIONS))} "
                                              f"(sections are {show(sorted(SECTIONS))})", name))
                continue
            if not isinstance(body, dict):
                problems.append(Problem(name, f"section '{name}' must be a JSON object (got {show(body)})", body))
                continue
            try:
                body = _apply_aliases(name, body)
            except ObsConfigError as exc:
                problems.append(Problem(exc.option, str(exc)))
                continue
            out[name] = _check_section(name, body, problems)
    if problems:
        raise ConfigFileError(path, problems)
    return ParsedFile(path, out)


def _check_section(name: str, body: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    table = SECTIONS[name]
    values: dict[str, Any] = {}
    for key, raw in body.items():
        full = f"{name}.{key}"
        if key not in table:
            problems.append(Problem(full, f"section '{name}' has no key {show(key)}{did_you_mean(key, tuple(table))} "
                                          f"(its keys are {show(sorted(table))})", raw))
            continue
        if raw is None:
            continue
        try:
            values[key] = table[key].check(raw, full)
        except (ObsConfigError, ObsConfigTypeError) as exc:
            problems.append(Problem(full, str(exc), raw))
    for check in SECTION_CHECKS.get(name, ()):
        message = check(values)
        if message:
            problems.append(Problem(name, message))
    return values


def _ring_fits(values: Mapping[str, Any]) -> str:
    """The recorder's ring file, all rings together, must fit the per-rank bound (a clear error otherwise)."""
    try:
        check_capacity(values.get("capacity", {}))
    except ObsConfigError as exc:
        return str(exc)
    return ""


#: Checks of a whole section after its keys passed: message, or "" when the section is fine.
SECTION_CHECKS: dict[str, list[Any]] = {"rdr": [_ring_fits], "dump": [check_dump_section],
                                         "monitor": [check_monitor_section]}


def show_json(value: Any) -> str:
    with json_words():
        return show(value)


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            type(None): "null"}.get(type(value), type(value).__name__)


def _apply_aliases(section: str, body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    for (sec, alias), key in ALIASES.items():
        if sec == section and alias in out:
            if key in out:
                raise ObsConfigError(f"'{section}.{key}' is given twice (as {show(key)} and {show(alias)})",
                                     option=f"{section}.{key}")
            out[key] = out.pop(alias)
    return out


def load_file(path: str) -> ParsedFile:
    """Read and validate ``path``; a missing or unreadable file is an :class:`ObsConfigError` too."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise _err(path, "does not exist") from None
    except IsADirectoryError:
        raise _err(path, "is a directory, not a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _err(path, f"cannot be read ({exc})") from None
    return parse_text(text, path)


def parse_env(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The ``MS_RDR_*`` variables present in ``environ``, validated."""
    out: dict[str, dict[str, Any]] = {}
    for var, (section, key) in ENV_VARS.items():
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        value: Any
        if key == "enable":
            if raw.strip().lower() not in ("0", "1", "true", "false"):
                raise ObsConfigError(f"environment variable {var} must be 1 or 0 (got {raw!r})", option=var,
                                     value=raw, source=var)
            value = raw.strip().lower() in ("1", "true")
        elif key == "mode":
            if raw.strip() not in ("1", "2"):
                raise ObsConfigError(f"environment variable {var} must be 1 or 2 (got {raw!r})", option=var,
                                     value=raw, source=var)
            value = int(raw)
        else:
            try:
                value = SECTIONS[section][key].check(raw, var)
            except ObsConfigError as exc:
                raise ObsConfigError(f"environment variable {exc}", option=var, value=raw, source=var) from None
        out.setdefault(section, {})[key] = value
    return out


def resolve(parsed: ParsedFile | None, environ: Mapping[str, str]) -> EnvConfig:
    """Merge defaults, then the environment, then the file (the file wins, as in MindSpore's RDR)."""
    env = parse_env(environ)
    env_names = {(s, k): v for v, (s, k) in ENV_VARS.items()}
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, dict[str, str]] = {}
    for section, table in SECTIONS.items():
        values[section] = table.defaults()
        origins[section] = {key: "default" for key in table}
        for key, value in env.get(section, {}).items():
            values[section][key] = value
            origins[section][key] = f"env {env_names[(section, key)]}"
        if parsed is not None:
            for key, value in parsed.sections.get(section, {}).items():
                values[section][key] = value
                origins[section][key] = "file"
    return EnvConfig(values, origins, parsed.path if parsed is not None else "")

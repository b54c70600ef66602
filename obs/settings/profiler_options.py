"""The profiler's options: ``profiling_options`` (MindSpore's two forms), the env config ``profiler`` section,
and the one :class:`ProfileRequest` both resolve to.

``profiling_options`` is a plain string of levels joined by ``:`` (``"training_trace"``,
``"training_trace:task_trace:op_trace"``) or a JSON object as text (``'{"output": "/abs/dir",
"training_trace": "on", "task_trace": "on", "op_trace": "on"}'``).  MindSpore's Ascend-only
keys (``aicpu``, ``fp_point``, ``aic_metrics``, ...) are accepted and have no effect.  The file's
``profiler`` section wins over the context keys for what it sets.  Light: no torch, no opentelemetry.

Metrics (:data:`METRICS_OPTIONS`, rows of the ``profiler`` section) fall back to OpenTelemetry's standard
variables where a key is left empty: ``OTEL_METRICS_EXPORTER``, ``OTEL_EXPORTER_PROMETHEUS_HOST`` and
``OTEL_EXPORTER_PROMETHEUS_PORT``; each rank serves Prometheus on the port plus its ``LOCAL_RANK``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from obs._core import env
from obs._core.errors import ObsConfigError
from obs.settings._table import Option
from obs.settings._validators import Choice, Int, Str, Validator, did_you_mean, fail, type_fail

__all__ = ["ASCEND_ONLY", "DEFAULT_OUTPUT", "DEFAULT_PROMETHEUS_HOST", "DEFAULT_PROMETHEUS_PORT", "LEVELS",
           "MAX_WINDOW_STEPS", "METRICS_EXPORTERS", "METRICS_OPTIONS", "WINDOW_LEVELS", "CaptureWindow", "Endpoint",
           "Levels", "ProfileRequest", "ProfilingOptions", "Steps", "Window", "capture_params", "metrics_exporters",
           "parse_levels", "parse_window", "prometheus_address", "request"]

LEVELS = ("training_trace", "task_trace", "op_trace")
ASCEND_ONLY = ("aicpu", "fp_point", "bp_point", "aic_metrics", "hccl", "storage_limit", "profile_memory",
               "profile_communication")
DEFAULT_OUTPUT = "./obs_profile"
METRICS_EXPORTERS = ("otlp", "prometheus")
DEFAULT_PROMETHEUS_HOST = "localhost"  # OpenTelemetry's defaults for its Prometheus exporter
DEFAULT_PROMETHEUS_PORT = 9464
WINDOW_LEVELS = ("task_trace", "op_trace")  #: the detail a capture window records (op_trace: modules and ops)
MAX_WINDOW_STEPS = 100_000  #: the longest capture window, in steps
_WINDOW_KEYS = ("start", "steps", "level")


def parse_levels(value: Any, name: str) -> tuple[str, ...]:
    """``"training_trace:task_trace"`` → the levels in canonical order (training_trace always included)."""
    if not isinstance(value, str):
        raise type_fail(name, "levels joined by ':' such as 'training_trace:task_trace'", value)
    parts = [p.strip() for p in value.split(":")]
    for part in parts:
        if part not in LEVELS:
            raise fail(name, f"levels joined by ':', each one of {', '.join(LEVELS)}"
                             f"{did_you_mean(part, LEVELS) if part else ''}", value)
    return tuple(level for level in LEVELS if level in parts or level == "training_trace")


def _json_options(text: str, name: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(name, f"valid JSON text (line {exc.lineno} column {exc.colno}: {exc.msg})", text) from None
    if not isinstance(parsed, dict):
        raise fail(name, "a JSON object", text)
    for key, value in parsed.items():
        full = f"{name}.{key}"
        if key in LEVELS:
            if value not in ("on", "off"):
                raise fail(full, "'on' or 'off'", value)
        elif key == "output":
            if not isinstance(value, str) or not value.startswith("/"):
                raise fail(full, "an absolute folder path (starting with '/')", value)
        elif key not in ASCEND_ONLY:
            raise fail(name, f"a JSON object with keys among output, {', '.join(LEVELS)} (or the Ascend-only "
                             f"{', '.join(ASCEND_ONLY)}){did_you_mean(key, (*LEVELS, 'output'))}", key)
    return parsed


@dataclass(frozen=True)
class ProfilingOptions(Validator):
    """The context key: levels joined by ':' or a JSON object as text (checked now, kept verbatim)."""

    def __call__(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise type_fail(name, "a str (levels joined by ':' or a JSON object as text)", value)
        if value.lstrip().startswith("{"):
            _json_options(value, name)
        elif not value:
            raise fail(name, "a non-empty string", value)
        else:
            parse_levels(value, name)
        return value

    def describe(self) -> str:
        return "str (levels joined by ':' or JSON object text)"


@dataclass(frozen=True)
class Levels(Validator):
    """The ``profiler.options`` key: levels joined by ':'."""

    def __call__(self, value: Any, name: str) -> str:
        return ":".join(parse_levels(value, name))

    def describe(self) -> str:
        return "levels joined by ':' (" + ", ".join(LEVELS) + ")"


@dataclass(frozen=True)
class Steps(Validator):
    """The ``profiler.steps`` key: ``"0-100|200"``, ``""`` (every step) or N (every N-th step)."""

    def __call__(self, value: Any, name: str) -> Any:
        from exporters.step_filter import parse_steps

        try:
            parse_steps(value)
        except ValueError as exc:
            raise fail(name, f"steps such as \"0-100|200\" or a whole number N for every N-th step ({exc})",
                       value) from None
        return value

    def describe(self) -> str:
        return "\"0-100|200\" | N (every N-th step) | \"\" (all)"


@dataclass(frozen=True)
class Endpoint(Validator):
    """``http(s)://host:port[/path]`` of an OTLP collector, or ``""``."""

    def __call__(self, value: Any, name: str) -> str:
        from urllib.parse import urlsplit

        if not isinstance(value, str):
            raise type_fail(name, "a URL such as 'http://localhost:4318'", value)
        if value:
            parts = urlsplit(value)
            try:
                port = parts.port
            except ValueError:
                port = -1
            if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
                raise fail(name, "a URL such as 'http://localhost:4318' (http or https, a host, an optional port)",
                           value)
        return value

    def describe(self) -> str:
        return "URL (empty: OTEL_EXPORTER_OTLP_ENDPOINT, else local files)"


@dataclass(frozen=True)
class CaptureWindow:
    """Detail for steps ``start`` .. ``start + steps - 1`` (numbered as ``obs.steps`` / ``obs.step`` count them):
    module spans (``task_trace``), or module and op spans (``op_trace``)."""

    start: int
    steps: int
    level: str = "task_trace"

    @property
    def last(self) -> int:
        return self.start + self.steps - 1

    def covers(self, step: int) -> bool:
        return self.start <= step <= self.last


def _window_steps(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_fail(name, f"a whole number of steps in [1, {MAX_WINDOW_STEPS}]", value)
    if not 1 <= value <= MAX_WINDOW_STEPS:
        raise fail(name, f"a whole number of steps in [1, {MAX_WINDOW_STEPS}]", value)
    return value


def _window_level(value: Any, name: str) -> str:
    if value not in WINDOW_LEVELS:
        raise fail(name, f"one of {', '.join(WINDOW_LEVELS)}"
                         f"{did_you_mean(value, WINDOW_LEVELS) if isinstance(value, str) and value else ''}", value)
    return str(value)


def parse_window(value: Any, name: str) -> CaptureWindow | None:
    """``{"start": S, "steps": N, "level": "task_trace"|"op_trace"}`` (level optional: task_trace) → the window;
    ``{}`` or None → no window.  Errors name the key, what it must be and the value."""
    if value is None or (isinstance(value, Mapping) and not value):
        return None
    if not isinstance(value, Mapping):
        raise type_fail(name, 'an object such as {"start": 20, "steps": 5, "level": "task_trace"} (or {}: none)',
                        value)
    for key in value:
        if key not in _WINDOW_KEYS:
            raise fail(name, f"an object with keys start, steps and level{did_you_mean(str(key), _WINDOW_KEYS)}",
                       key)
    for key in ("start", "steps"):
        if key not in value:
            raise fail(name, f'an object with "{key}" (a window is {{"start": S, "steps": N, "level": ...}})', value)
    start = value["start"]
    if isinstance(start, bool) or not isinstance(start, int):
        raise type_fail(f"{name}.start", "a step number >= 1", start)
    if start < 1:
        raise fail(f"{name}.start", "a step number >= 1 (steps count from 1)", start)
    steps = _window_steps(value["steps"], f"{name}.steps")
    level = _window_level(value.get("level", "task_trace"), f"{name}.level")
    return CaptureWindow(start, steps, level)


def capture_params(params: Mapping[str, Any], name: str = "capture") -> tuple[int, str]:
    """A capture request's ``{"steps": N, "level": L}`` → (N, L), checked as the window's keys are."""
    for key in params:
        if key not in ("steps", "level"):
            raise fail(name, f"params with keys steps and level{did_you_mean(str(key), ('steps', 'level'))}", key)
    if "steps" not in params:
        raise fail(name, 'params with "steps" (how many steps to capture)', dict(params))
    return (_window_steps(params["steps"], f"{name}.steps"),
            _window_level(params.get("level", "task_trace"), f"{name}.level"))


@dataclass(frozen=True)
class Window(Validator):
    """The ``profiler.window`` key: one capture window, or ``{}`` for none (kept as a plain dict)."""

    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        window = parse_window(value, name)
        return {} if window is None else {"start": window.start, "steps": window.steps, "level": window.level}

    def describe(self) -> str:
        return '{"start": S, "steps": N, "level": "task_trace"|"op_trace"} | {} (none)'


#: The ``profiler`` section's metrics rows (obs.settings.env_config_file puts them in the section's table).
METRICS_OPTIONS = [
    Option("metrics", Choice(("", "off", "otlp", "prometheus", "otlp,prometheus")), "",
           "Metrics per rank and step (step and phase times, steps/s, samples or tokens/s, peak memory, time in "
           "collectives, obs.scalar values), from the exporter process: off, otlp, prometheus or both "
           "('otlp,prometheus'); empty: OTEL_METRICS_EXPORTER, else off."),
    Option("prometheus_host", Str(pattern=r"[^\s/]*", expectation="a host name or address (no spaces, no '/')"), "",
           "Address the Prometheus endpoint listens on (empty: OTEL_EXPORTER_PROMETHEUS_HOST, else localhost)."),
    Option("prometheus_port", Int(min=0, max=65535), 0, "Prometheus port of local rank 0; each rank serves this "
           "plus its LOCAL_RANK (0: OTEL_EXPORTER_PROMETHEUS_PORT, else 9464)."),
    Option("batch_size", Int(min=0), 0, "Samples per step, for obs.samples (samples/s); 0: not given."),
    Option("tokens_per_step", Int(min=0), 0, "Tokens per step, for obs.tokens (tokens/s); 0: not given."),
]


def metrics_exporters(setting: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The metric exporters in force: ``profiler.metrics``, or where it is empty ``OTEL_METRICS_EXPORTER`` (a
    comma-separated list of otlp, prometheus, none); () when off.  A bad variable raises naming it."""
    if setting:
        return () if setting == "off" else tuple(setting.split(","))
    raw = env.text(env.OTEL_METRICS_EXPORTER, environ=environ).strip().lower()
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    for part in parts:
        if part not in (*METRICS_EXPORTERS, "none"):
            raise ObsConfigError(f"environment variable {env.OTEL_METRICS_EXPORTER} must list exporters among otlp, "
                                 f"prometheus, none, separated by commas (got {raw!r}); or set profiler.metrics",
                                 option=env.OTEL_METRICS_EXPORTER, value=raw)
    return tuple(e for e in METRICS_EXPORTERS if e in parts)


def prometheus_address(host: str, port: int, environ: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) this rank serves Prometheus on: the settings, else the standard variables, else localhost:9464;
    the port plus ``LOCAL_RANK``.  A bad variable raises naming it."""
    host = host or env.text(env.OTEL_EXPORTER_PROMETHEUS_HOST, DEFAULT_PROMETHEUS_HOST, environ).strip()
    try:
        base = port or env.integer(env.OTEL_EXPORTER_PROMETHEUS_PORT, DEFAULT_PROMETHEUS_PORT, environ)
        local = env.integer(env.LOCAL_RANK, 0, environ)
    except ValueError as exc:
        raise ObsConfigError(str(exc)) from None
    if not 1 <= base <= 65535:
        raise ObsConfigError(f"environment variable {env.OTEL_EXPORTER_PROMETHEUS_PORT} must be a port in [1, 65535] "
                             f"(got {base}); or set profiler.prometheus_port", option=env.OTEL_EXPORTER_PROMETHEUS_PORT,
                             value=base)
    if local < 0 or base + local > 65535:
        raise ObsConfigError(f"the Prometheus port of this rank, {base} + LOCAL_RANK {local}, is not a port in "
                             f"[1, 65535]; lower profiler.prometheus_port (or {env.OTEL_EXPORTER_PROMETHEUS_PORT})",
                             option="prometheus_port", value=base)
    return host, base + local


@dataclass(frozen=True)
class ProfileRequest:
    """What the profiler does, resolved from the context keys and the env config file (None: profiling off)."""

    levels: tuple[str, ...]
    output: str
    endpoint: str
    protocol: str
    steps: Any
    span_budget: int
    module_depth: int
    max_file_mb: int
    metrics: tuple[str, ...] = ()  #: metric exporters: otlp, prometheus (none: metrics off)
    prometheus: tuple[str, int] = (DEFAULT_PROMETHEUS_HOST, DEFAULT_PROMETHEUS_PORT)  #: this rank's host and port
    batch_size: int = 0
    tokens_per_step: int = 0
    #: the env config's capture window: applied to the session in force at a step boundary (never restarts it)
    window: CaptureWindow | None = field(default=None, compare=False)


def request(context: Mapping[str, Any], section: Mapping[str, Any], origins: Mapping[str, str],
            environ: Mapping[str, str] | None = None) -> ProfileRequest | None:
    """``context``: enable_profiling / profiling_options in force; ``section``: the file's profiler section
    values (with ``origins``: "default" or where a value came from); ``environ``: the variables metrics fall back
    to (default ``os.environ``)."""
    from_file = {key for key, origin in origins.items() if origin != "default"}
    enabled = section["enable"] if "enable" in from_file else bool(context.get("enable_profiling"))
    if not enabled:
        return None
    text = context.get("profiling_options") or "training_trace"
    output = ""
    if text.lstrip().startswith("{"):
        parsed = _json_options(text, "profiling_options")
        levels = tuple(level for level in LEVELS if parsed.get(level) == "on" or level == "training_trace")
        output = parsed.get("output", "")
    else:
        levels = parse_levels(text, "profiling_options")
    if "options" in from_file:
        levels = parse_levels(section["options"], "profiler.options")
    if "output" in from_file or not output:
        output = section["output"] or output
    environ = os.environ if environ is None else environ
    metrics = metrics_exporters(section.get("metrics", ""), environ)
    prometheus = (prometheus_address(section.get("prometheus_host", ""), section.get("prometheus_port", 0), environ)
                  if "prometheus" in metrics else (DEFAULT_PROMETHEUS_HOST, DEFAULT_PROMETHEUS_PORT))
    return ProfileRequest(levels=levels, output=os.path.abspath(output or DEFAULT_OUTPUT),
                          endpoint=section["endpoint"], protocol=section["protocol"], steps=section["steps"],
                          span_budget=section["span_budget"], module_depth=section["module_depth"],
                          max_file_mb=section["max_file_mb"], metrics=metrics, prometheus=prometheus,
                          batch_size=section.get("batch_size", 0), tokens_per_step=section.get("tokens_per_step", 0),
                          window=parse_window(section.get("window"), "profiler.window"))

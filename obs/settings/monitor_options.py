"""The env config's ``monitor`` section, and the msprobe monitor config file that ``monitor.config_file`` names.

One table drives both: a key of msprobe's file (``targets``, ``ops``, ``alert``, ...) is a row of the section too,
validated by the same validator, so a user's existing msprobe file works as it is and every key can also be set in
the section.  Precedence: defaults < the msprobe file < the section's own keys.  msprobe's keys that obs accepts but
does not act on (``forward_only``, ``squash_name``, ...) are validated by :data:`MSPROBE_ACCEPTED` and ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from obs._core.errors import ObsConfigError, ObsConfigTypeError
from obs.settings._table import Option, OptionTable
from obs.settings._validators import Bool, Choice, Int, Str, Validator, did_you_mean, fail, json_words, show, type_fail

__all__ = ["ACTIONS", "MONITOR_OPTIONS", "MSPROBE_ACCEPTED", "MSPROBE_KEYS", "OPS", "RULES", "check_monitor_section",
           "load_msprobe_config", "merged", "ring_capacity"]

#: the statistics msprobe's ``ops`` names (MonitorConst.OP_LIST); ``shape`` and ``dtype`` are columns it always adds
OPS = ("norm", "min", "max", "zeros", "nans", "id", "mean", "shape", "dtype")
#: msprobe's alert rules (MonitorConst.RULE_NAME)
RULES = ("AnomalyTurbulence", "AnomalyNan")


@dataclass(frozen=True)
class Number(Validator):
    """A finite int or float, at least ``min``."""

    min: float | None = None

    def __call__(self, value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise type_fail(name, "a number", value)
        if not math.isfinite(value) or (self.min is not None and value < self.min):
            raise fail(name, f"a finite number >= {self.min:g}" if self.min is not None else "a finite number", value)
        return float(value)

    def describe(self) -> str:
        return f"number >= {self.min:g}" if self.min is not None else "number"


@dataclass(frozen=True)
class ListOf(Validator):
    """A list whose items each pass ``item``."""

    item: Validator
    what: str

    def __call__(self, value: Any, name: str) -> list[Any]:
        if not isinstance(value, list):
            raise type_fail(name, f"a list of {self.what}", value)
        return [self.item(v, f"{name}[{i}]") for i, v in enumerate(value)]

    def describe(self) -> str:
        return f"list of {self.what}"


@dataclass(frozen=True)
class Ops(Validator):
    """msprobe's ``ops``: a non-empty list of statistic names, each once."""

    def __call__(self, value: Any, name: str) -> list[str]:
        ops = ListOf(Str(), "statistic names")(value, name)
        for i, op in enumerate(ops):
            if op not in OPS:
                raise ObsConfigError(f"'{name}[{i}]' must be one of {show(list(OPS))} (got {show(op)})"
                                     f"{did_you_mean(op, OPS)}", option=name, value=value)
        if not ops:
            raise fail(name, f"a non-empty list of statistics from {show(list(OPS))}", value)
        return list(dict.fromkeys(ops))

    def describe(self) -> str:
        return "list of " + " | ".join(OPS)


@dataclass(frozen=True)
class Targets(Validator):
    """msprobe's ``targets``: module or parameter name prefixes, each mapped to an object (what to watch of it)."""

    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise type_fail(name, 'an object of module names, e.g. {"h.0.mlp": {}}', value)
        for key, body in value.items():
            if not isinstance(body, dict):
                raise fail(f"{name}.{key}", 'an object (what to watch of the module, e.g. {"output": "tensor"})',
                           body)
        return dict(value)

    def describe(self) -> str:
        return "object: module name -> object"


@dataclass(frozen=True)
class CcDistribution(Validator):
    """msprobe's ``cc_distribution``: ``enable``, ``cc_codeline``, ``cc_pre_hook``, ``cc_log_only``."""

    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise type_fail(name, "an object with keys enable, cc_codeline, cc_pre_hook, cc_log_only", value)
        keys = {"enable": Bool(), "cc_pre_hook": Bool(), "cc_log_only": Bool(),
                "cc_codeline": ListOf(Str(), "code lines")}
        for key, sub in value.items():
            if key not in keys:
                raise ObsConfigError(f"'{name}' has no key {show(key)}{did_you_mean(str(key), tuple(keys))} (its "
                                     f"keys are {show(sorted(keys))})", option=name, value=value)
            keys[key](sub, f"{name}.{key}")
        return dict(value)

    def describe(self) -> str:
        return "object: enable, cc_codeline, cc_pre_hook, cc_log_only"


@dataclass(frozen=True)
class Alert(Validator):
    """msprobe's ``alert``: ``rules`` (``[{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]``) and
    ``dump``."""

    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise type_fail(name, 'an object like {"rules": [{"rule_name": "AnomalyTurbulence", "args": '
                                  '{"threshold": 0.5}}]}', value)
        for key in value:
            if key not in ("rules", "dump"):
                raise ObsConfigError(f"'{name}' has no key {show(key)} (its keys are ['dump', 'rules'])",
                                     option=name, value=value)
        Bool()(value.get("dump", False), f"{name}.dump")
        rules = value.get("rules", [])
        if not isinstance(rules, list):
            raise type_fail(f"{name}.rules", "a list of rules", rules)
        for i, rule in enumerate(rules):
            where = f"{name}.rules[{i}]"
            if not isinstance(rule, dict):
                raise type_fail(where, 'an object like {"rule_name": "AnomalyTurbulence", "args": {...}}', rule)
            extra = sorted(set(rule) - {"rule_name", "args"})
            if extra:
                raise ObsConfigError(f"'{where}' has no key {show(extra[0])} (its keys are ['args', 'rule_name'])",
                                     option=where, value=rule)
            Choice(RULES)(rule.get("rule_name"), f"{where}.rule_name")
            args = rule.get("args", {})
            if args is None:
                args = {}
            if not isinstance(args, dict):
                raise type_fail(f"{where}.args", 'an object like {"threshold": 0.5}', args)
            for key in args:
                if key != "threshold":
                    raise ObsConfigError(f"'{where}.args' has no key {show(key)} (its keys are ['threshold'])",
                                         option=where, value=args)
            if rule["rule_name"] == "AnomalyTurbulence" and "threshold" not in args:
                raise fail(f"{where}.args", 'an object with a "threshold" (AnomalyTurbulence needs one)', args)
            if "threshold" in args:
                Number(min=0)(args["threshold"], f"{where}.args.threshold")
        return dict(value)

    def describe(self) -> str:
        return "object: rules, dump"


#: what an anomaly may do (``monitor.on_anomaly``)
ACTIONS = ("capture", "bundle", "raise")


@dataclass(frozen=True)
class Actions(Validator):
    """``on_anomaly``: a list of actions from :data:`ACTIONS`, each once."""

    def __call__(self, value: Any, name: str) -> list[str]:
        actions = ListOf(Str(), "actions")(value, name)
        for i, action in enumerate(actions):
            if action not in ACTIONS:
                raise ObsConfigError(f"'{name}[{i}]' must be one of {show(list(ACTIONS))} (got {show(action)})"
                                     f"{did_you_mean(action, ACTIONS)}", option=name, value=value)
        return list(dict.fromkeys(actions))

    def describe(self) -> str:
        return "list of " + " | ".join(ACTIONS)


_ABS = Str(non_empty=True, pattern=r"/.*", expectation="an absolute path (starting with '/')")

#: Keys of msprobe's monitor config file that are rows of the section too.
MSPROBE_KEYS = frozenset({"targets", "all_xy", "xy_distribution", "wg_distribution", "mv_distribution",
                          "ur_distribution", "cc_distribution", "ops", "eps", "alert", "format", "start_step",
                          "step_interval", "collect_times", "print_struct", "module_ranks", "ndigits",
                          "step_count_per_record"})

MONITOR_OPTIONS = OptionTable("monitor", [
    Option("enable", Bool(), False, "Turn the training-health monitor on: per-parameter gradient norm, update norm "
           "and update/weight ratio, the global gradient norm and the loss at every optimizer step, written as "
           "msprobe's CSV files, with anomalies reported on stderr."),
    Option("path", _ABS, "", "Absolute output folder (MONITOR_OUTPUT_DIR wins, as in msprobe; empty: "
           "./monitor_output); each run writes {path}/{time}-rank{r}-{id}/."),
    Option("config_file", _ABS, "", "An msprobe monitor config file (absolute path), accepted as it is; the "
           "section's own keys win over it."),
    Option("targets", Targets(), {}, "msprobe's targets: module or parameter name prefixes to watch ({\"\": {}} or "
           "{}: every parameter); also the modules whose activations xy_distribution records."),
    Option("xy_distribution", Bool(), False, "Record module activations (inputs and outputs) of the targets' "
           "modules (all modules with all_xy) in forward, eager mode."),
    Option("all_xy", Bool(), False, "With xy_distribution: every module's activations."),
    Option("wg_distribution", Bool(), False, "Every statistic of ops for each gradient (off: the gradient norm "
           "only)."),
    Option("mv_distribution", Bool(), False, "The statistics of the optimizer's moments (Adam's exp_avg and "
           "exp_avg_sq)."),
    Option("ur_distribution", Bool(), False, "Every statistic of ops for each update (off: the update norm and the "
           "update/weight ratio only)."),
    Option("cc_distribution", CcDistribution(), {}, "msprobe's collective statistics (enable): ops of the tensors "
           "of each torch.distributed collective called from Python, after it (and before it with cc_pre_hook), "
           "calls whose stack matches a regex of cc_codeline; cc_log_only lists the call sites once instead."),
    Option("ops", Ops(), ["norm"], "Statistics of each tensor: norm, min, max, mean, zeros (share below eps), nans, "
           "id; shape and dtype columns are always written, as msprobe does."),
    Option("eps", Number(min=0), 1e-8, "Below this, an element counts as zero (the zeros statistic)."),
    Option("ndigits", Int(min=1, max=20), 6, "Significant digits of the values in the CSV files."),
    Option("alert", Alert(), {}, "msprobe's alert rules, added to the default robust rule: AnomalyTurbulence "
           "(threshold: above the running mean by that share) and AnomalyNan."),
    Option("format", Choice(("csv", "tensorboard", "api")), "csv", "csv: msprobe's CSV files; api: none written "
           "(anomalies still reported); tensorboard: a TensorBoard event file too, in msprobe's tags, beside the CSV "
           "files (the tensorboard extra: pip install 'obs-runtime[tensorboard]')."),
    Option("start_step", Int(min=0), 0, "First optimizer step collected (counting from 0, as msprobe)."),
    Option("step_interval", Int(min=1), 1, "Collect every N-th step from start_step."),
    Option("collect_times", Int(min=0), 100_000_000, "Stop after collecting this many steps."),
    Option("step_count_per_record", Int(min=1, max=1_000_000), 100, "Steps per CSV file ({prefix}_{a}-{b}.csv); "
           "msprobe's default is 1."),
    Option("print_struct", Bool(), False, "Write module_struct.json (every module's input and output shapes) after "
           "the first step; unlike msprobe, training goes on."),
    Option("module_ranks", ListOf(Int(min=0), "ranks"), [], "Ranks that collect ([]: all)."),
    Option("update_sample", Int(min=0, max=1 << 40), 4096, "The update norm and update/weight ratio of a parameter "
           "with more elements come from a fixed sample of at most this many of them, in 32 evenly spaced runs (the "
           "norm scaled to the whole), so a step copies no more; 0: exact (a copy of every parameter at every "
           "step). Exact with ur_distribution."),
    Option("window", Int(min=3, max=100_000), 50, "The robust rule's history: the last W collected steps."),
    Option("warmup", Int(min=0, max=1_000_000), 20, "Steps of a series not judged, at its start (and the least "
           "history the robust rule needs)."),
    Option("threshold", Number(min=0), 10.0, "The robust rule flags a value further than this many robust standard "
           "deviations (1.4826 x the MAD) from the median of its history, in either direction."),
    Option("ring_steps", Int(min=1, max=1024), 64, "With the Running Data Recorder on: the last N steps of every "
           "series kept in its ring, so every bundle (crash, hang, snapshot, obs rdr recover) holds them."),
    Option("ring_series", Int(min=16, max=8192), 1024, "The series the ring's monitor region has room for at "
           "ring_steps steps (56 bytes per value: 64 x 1024 is 3.5 MiB); more series keep fewer steps."),
    Option("on_anomaly", Actions(), [], "What an anomaly does besides its stderr line, ring marker and metric: "
           "capture (the next capture_steps steps' statistic data dump and a profiler capture window), bundle (a "
           "non-fatal RDR bundle, reason anomaly), raise (MonitorAnomalyError in the training loop at the step's "
           "end)."),
    Option("capture_steps", Int(min=1, max=10_000), 5, "Steps a capture action records."),
])

#: msprobe's keys that obs accepts (type-checked) and does not act on.
MSPROBE_ACCEPTED: dict[str, Validator] = {
    "forward_only": Bool(), "backward_only": Bool(), "squash_name": Bool(), "param_distribution": Bool(),
    "mg_direction": Bool(), "stack_info": Bool(), "monitor_mbs_grad": Bool(), "dynamic_on": Bool(),
    "recording_l2_features": Bool(), "mg_distribution": Bool(), "append_output": ListOf(Str(), "time tags"),
    "l2_targets": Targets(),
}


def _problems_of(body: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    values: dict[str, Any] = {}
    problems: list[str] = []
    with json_words():
        for key, raw in body.items():
            full = f"{where}.{key}"
            try:
                if key in MSPROBE_KEYS:
                    values[key] = MONITOR_OPTIONS[key].check(raw, key)
                elif key in MSPROBE_ACCEPTED:
                    MSPROBE_ACCEPTED[key](raw, key)
                else:
                    known = tuple(sorted(MSPROBE_KEYS | set(MSPROBE_ACCEPTED)))
                    problems.append(f"{full}: unknown key {show(key)}{did_you_mean(str(key), known)} (msprobe's "
                                    f"monitor keys are {show(list(known))})")
            except (ObsConfigError, ObsConfigTypeError) as exc:
                problems.append(f"{where}: {exc}")
    return values, problems


def load_msprobe_config(path: str) -> dict[str, Any]:
    """The keys of msprobe's monitor config file ``path`` that obs acts on, validated; every problem of the file in
    one :class:`ObsConfigError` naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(1 << 20)
    except OSError as exc:
        raise ObsConfigError(f"monitor.config_file {path}: cannot be read ({exc.strerror or exc})",
                             option="monitor.config_file", value=path, source=path) from None
    except UnicodeDecodeError as exc:
        raise ObsConfigError(f"monitor.config_file {path}: is not UTF-8 text (byte offset {exc.start})",
                             option="monitor.config_file", value=path, source=path) from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ObsConfigError(f"monitor.config_file {path}: is not valid JSON{where}", option="monitor.config_file",
                             value=path, source=path) from None
    if not isinstance(data, dict):
        raise ObsConfigError(f"monitor.config_file {path}: must hold a JSON object of msprobe's monitor keys",
                             option="monitor.config_file", value=path, source=path)
    values, problems = _problems_of(data, path)
    if problems:
        raise ObsConfigError(f"monitor.config_file {path} has {len(problems)} problem(s):" + "".join(
            f"\n  - {p}" for p in problems), option="monitor.config_file", value=path, source=path)
    return values


def check_monitor_section(values: Mapping[str, Any]) -> str:
    """The section's ``config_file``, read and checked: "" when fine, else its problems."""
    path = values.get("config_file", "")
    if not path:
        return ""
    try:
        load_msprobe_config(path)
    except ObsConfigError as exc:
        return str(exc)
    return ""


def ring_capacity(section: Mapping[str, Any]) -> dict[str, int]:
    """The RDR ring's monitor rings (slots) for the ``monitor`` section in force; ``{}`` when it is off."""
    if not section.get("enable"):
        return {}
    from recorder.monitor_part import ANOMALY_SLOTS

    steps = section.get("ring_steps", MONITOR_OPTIONS["ring_steps"].default)
    series = section.get("ring_series", MONITOR_OPTIONS["ring_series"].default)
    return {"monitor": int(steps) * int(series), "monitor_anomaly": ANOMALY_SLOTS}


def merged(section: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """The monitor's settings in force: defaults, then the msprobe file, then the keys the section set itself."""
    out = dict(section)
    path = section.get("config_file", "")
    if path:
        for key, value in load_msprobe_config(path).items():
            if origins.get(key, "default") == "default":
                out[key] = value
    return out

"""``obs config check FILE``: validate an env config file and show what it would turn on."""

from __future__ import annotations

import errno
import os
from typing import Any

from rich.table import Table

from obs.cli._render import console, err_console, markup_text, print_json
from obs.settings.env_config_file import ConfigFileError, EnvConfig, load_file, resolve

__all__ = ["describe", "run_check"]


def describe(cfg: EnvConfig) -> list[str]:
    """Plain sentences saying what the settings turn on."""
    rdr = cfg.values["rdr"]
    lines = []
    if rdr["enable"]:
        when = "on faults" if rdr["mode"] == 1 else "on faults and at normal end"
        lines.append(f"Running Data Recorder ON at {rdr['granularity']} granularity: dumps {when} into "
                     f"{rdr['path'] or os.getcwd()}/rank_<r>/rdr/ (hangs: {rdr['hang_action']})")
    else:
        lines.append("Running Data Recorder off (rdr.enable is false)")
    lines.append(f"device memory reuse {'on' if cfg.values['sys']['mem_reuse'] else 'off'}")
    prof = cfg.values.get("profiler", {})
    if prof.get("enable"):
        where = prof["endpoint"] or "OTEL_EXPORTER_OTLP_ENDPOINT if set, else " + \
            f"{prof['output'] or './obs_profile'}/rank_<r>/trace.json and traces.otlp.jsonl"
        lines.append(f"profiler ON ({prof['options'].replace(':', ', ')}; at most {prof['span_budget']} spans per "
                     f"step{', steps ' + str(prof['steps']) if prof['steps'] != '' else ''}): spans to {where}")
    if cfg.values.get("exception_dump", {}).get("enable"):
        lines.append(f"exception dump ON (mode {cfg.values['exception_dump']['mode']}): the failing op or module's "
                     "inputs go to <path>/rank_<r>/exception_dump/")
    if cfg.values.get("nan_check", {}).get("enable"):
        lines.append(f"NaN/Inf check ON at {cfg.values['nan_check']['granularity']} granularity "
                     f"(then {cfg.values['nan_check']['action']})")
    monitor = cfg.values.get("monitor", {})
    if monitor.get("enable"):
        from obs.features.monitor.feature import output_root
        from obs.settings.monitor_options import merged

        m = merged(monitor, cfg.origins.get("monitor", {}))
        extra = [what for key, what in (("xy_distribution", "activations"), ("wg_distribution", "every gradient "
                 "statistic"), ("ur_distribution", "every update statistic"), ("mv_distribution", "Adam's moments"))
                 if m.get(key)]
        cc = m["cc_distribution"]
        if cc.get("enable"):
            extra.append("the call sites of collectives (cc_log_only)" if cc.get("cc_log_only") else "collectives")
        files = "no files (format api)" if m["format"] == "api" else f"CSV files under {output_root(m)}/"
        lines.append(f"training-health monitor ON: gradient and update norms, update ratios, loss"
                     f"{' + ' + ', '.join(extra) if extra else ''}; {files}"
                     f"{'; msprobe config ' + m['config_file'] if m['config_file'] else ''}")
    if cfg.values.get("dump", {}).get("common_dump_settings"):
        from obs.settings.dump_config import describe_dump, parse_dump_config

        lines += describe_dump(parse_dump_config(cfg.values["dump"]))
    return lines


def run_check(path: str, *, as_json: bool) -> int:
    """Exit 0 valid, 1 the file has problems (all listed), 2 no such file (bad input)."""
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"env config file {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"env config file {path!r} is a folder, not a JSON file")
    from obs.settings.dump_config import is_dump_config

    if is_dump_config(path):  # MINDSPORE_DUMP_CONFIG's format
        from obs.cli._dump_view import run_config_check

        return run_config_check(path, as_json=as_json)
    try:
        cfg = resolve(load_file(path), os.environ)
    except ConfigFileError as exc:
        if as_json:
            print_json({"file": path, "valid": False, "problems": [
                {"key": p.key, "message": p.message, "value": p.value} for p in exc.problems]})
        else:
            err = err_console()
            count = len(exc.problems)
            err.print(f"[bold red]obs: {markup_text(path)} is invalid[/] ({count} problem{'s' * (count != 1)}):",
                      markup=True)
            for problem in exc.problems:
                text = problem.message if problem.key else f"the file {problem.message}"
                err.print(f"  [red]✗[/] {markup_text(text)}", markup=True)
        return 1
    if as_json:
        data: dict[str, Any] = {"file": path, "valid": True, "settings": cfg.as_dict(),
                                "origins": {s: dict(o) for s, o in cfg.origins.items()}, "turns_on": describe(cfg)}
        print_json(data)
        return 0
    out = console()
    view = Table(title=f"{path}: valid", title_justify="left")
    for column in ("key", "value", "from"):
        view.add_column(column)
    for section, keys in cfg.values.items():
        for key, value in keys.items():
            view.add_row(f"{section}.{key}", repr(value), cfg.origins[section][key])
    out.print(view)
    for line in describe(cfg):
        out.print(f"• {line}")
    return 0

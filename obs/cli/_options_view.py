"""``obs options``: every option table rendered from the tables themselves."""

from __future__ import annotations

import sys
from typing import Any

from rich.table import Table

from obs.cli._render import console, print_json
from obs.settings._table import OptionTable

__all__ = ["run_options", "tables"]


def tables(which: str) -> dict[str, OptionTable]:
    from obs.settings.context_options import CONTEXT_OPTIONS
    from obs.settings.dump_config import TOP
    from obs.settings.env_config_file import SECTIONS
    from obs.settings.parallel import AUTO_PARALLEL_OPTIONS, PS_OPTIONS

    out = {"context": CONTEXT_OPTIONS, "auto_parallel": AUTO_PARALLEL_OPTIONS, "ps": PS_OPTIONS}
    out |= {f"env_config.{name}": table for name, table in SECTIONS.items()}
    out |= {f"dump_config.{name}": table for name, table in TOP.items()}
    return {k: v for k, v in out.items() if which in ("all", k, k.split(".")[0])}


def _rows(table: OptionTable) -> list[dict[str, Any]]:
    return [{"name": row.name, "type": row.type_name, "default": row.default, "required": row.required,
             "devices": row.device_names(), "meaning": row.doc, "deprecated": row.deprecated, "pytorch": row.effect}
            for row in table.values()]


def _default(row: dict[str, Any]) -> str:
    return "required" if row["required"] else repr(row["default"])


def run_options(which: str, *, as_json: bool) -> int:
    selected = tables(which)
    if as_json:
        print_json({name: _rows(table) for name, table in selected.items()})
        return 0
    if not sys.stdout.isatty():
        _plain(selected)
        return 0
    out = console()
    for name, table in selected.items():
        view = Table(title=f"{name} ({table.title})", title_justify="left", show_lines=False, expand=False)
        for column in ("name", "type", "default", "devices", "meaning"):
            view.add_column(column, overflow="fold", style="bold cyan" if column == "name" else None)
        for row in _rows(table):
            view.add_row(row["name"], row["type"], _default(row), row["devices"], _meaning(row, markup=True))
        out.print(view)
    return 0


def _plain(selected: dict[str, OptionTable]) -> None:
    """Off a terminal: one tab-separated line per option (table, name, type, default, devices, meaning), for grep
    and cut; nothing is wrapped or cut."""
    write = sys.stdout.write
    write("table\tname\ttype\tdefault\tdevices\tmeaning\n")
    for name, table in selected.items():
        for row in _rows(table):
            cells = (name, row["name"], row["type"], _default(row), row["devices"], _meaning(row, markup=False))
            write("\t".join(cells) + "\n")


def _meaning(row: dict[str, Any], *, markup: bool) -> str:
    """The meaning, then what it does in PyTorch and any deprecation (coloured on a terminal)."""
    green, yellow, end = ("[green]", "[yellow]", "[/]") if markup else ("", "", "")
    meaning = row["meaning"]
    if row["pytorch"]:
        meaning += f" {green}PyTorch: {row['pytorch']}{end}"
    if row["deprecated"]:
        meaning += f" {yellow}Deprecated: {row['deprecated']}{end}"
    return meaning

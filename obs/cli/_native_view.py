"""``obs native status | build``: which native extensions are in use, and why not (rendering only)."""

from __future__ import annotations

import importlib
from dataclasses import asdict

from rich.table import Table

from obs.cli._exit import EXIT_FAILURE, EXIT_OK
from obs.cli._render import console, markup_text, print_json

__all__ = ["run_native"]

#: The modules that declare obs's extensions (importing one declares its extensions).
DECLARING = ("recorder.hotpath", "recorder.native_ops", "obs.features.dump.stats.tensor_stats",
             "obs.features.dump.stats.native_rows", "obs.features.dump.nan.native_check",
             "obs.features.monitor.norms", "obs.features.monitor.detect")


def run_native(*, build: bool, as_json: bool) -> int:
    from obs._core import native

    for module in DECLARING:
        importlib.import_module(module)
    rows = native.status(build=build)
    if as_json:
        print_json({"extensions": [asdict(r) | {"in_use": r.in_use} for r in rows], "parts": native.PARTS})
    else:
        table = Table(title="obs native extensions")
        for column in ("extension", "part (switch)", "built at", "state", "why not"):
            table.add_column(column, overflow="fold")
        for r in rows:
            state = r.state if r.state != "unavailable" else f"[red]{r.state}[/]"
            table.add_row(markup_text(r.name), f"{r.part} ({native.switch_name(r.part)}=0)", r.built_at, state,
                          markup_text(r.reason or ""))
        console().print(table)
    return EXIT_FAILURE if any(r.state == "unavailable" for r in rows) else EXIT_OK

"""Shared rendering helpers: one console per stream, plain errors, JSON out."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

__all__ = ["console", "err_console", "error", "print_json"]


def console() -> Console:
    return Console(highlight=False)


def err_console() -> Console:
    return Console(stderr=True, highlight=False)


def error(message: str) -> None:
    err_console().print(f"[bold red]obs: error:[/] {message}", markup=True,
                                                soft_wrap=True)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")

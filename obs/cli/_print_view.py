"""``obs print FILE``: render a print file (parse_print, pretty), follow a live one, or emit JSON lines."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.text import Text

from obs.cli._render import console, err_console, error
from printsink.dtypes import NAME_OF_NUMPY
from printsink.reader import PrintCall, PrintFileError, PrintFileWarning, TruncatedPrintFile, follow_print, iter_print
from printsink.screen import format_array

__all__ = ["call_to_json", "run_print"]

_PROGRESS_MIN_BYTES = 16 << 20


def _dtype_name(array: np.ndarray) -> str:
    return NAME_OF_NUMPY.get(array.dtype.newbyteorder("="), str(array.dtype))


def _json_number(x: Any) -> Any:
    if isinstance(x, complex):
        return [_json_number(x.real), _json_number(x.imag)]
    if isinstance(x, float) and not np.isfinite(x):
        return "nan" if np.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _json_value(value: Any) -> Any:
    if isinstance(value, str):
        return {"type": "str", "value": value}
    data = value.tolist()
    if value.dtype.kind in "fc" and (value.dtype.kind == "c" or not np.isfinite(value).all()):
        data = np.vectorize(_json_number, otypes=[object])(value).tolist() if value.size else data
    return {"type": "tensor", "dtype": _dtype_name(value), "shape": list(value.shape), "value": data}


def call_to_json(call: PrintCall) -> dict[str, Any]:
    """One call as a JSON-able dict (non-finite floats as "nan"/"inf"/"-inf", complex as [re, im])."""
    out: dict[str, Any] = {"offset": call.offset}
    if call.meta is not None:
        m = call.meta
        out.update(seq=m.seq, time_ns=m.time_ns, step=m.step, rank=m.rank, pid=m.pid, source=m.source)
    out["values"] = [_json_value(v) for v in call.values]
    return out


def _header(call: PrintCall) -> Text:
    m = call.meta
    if m is None:
        return Text(f"@{call.offset}", style="dim")
    stamp = time.strftime("%H:%M:%S", time.localtime(m.time_ns / 1e9)) + f".{m.time_ns // 1_000_000 % 1000:03d}"
    return Text(f"#{m.seq}  step {m.step}  rank {m.rank}  pid {m.pid}  {stamp}  {m.source}", style="dim cyan")


def _render_value(value: Any) -> Text:
    if isinstance(value, str):
        return Text(value)
    return Text(format_array(value, _dtype_name(value)), style="green" if value.ndim == 0 else "")


def _with_progress(calls: Iterator[PrintCall], size: int) -> Iterator[PrintCall]:
    columns = (TextColumn("reading"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=err_console(), transient=True) as progress:
        task = progress.add_task("read", total=size)
        for call in calls:
            progress.update(task, completed=call.end)
            yield call


def run_print(path: str, *, follow: bool, as_json: bool, partial: bool, poll_s: float = 0.25) -> int:
    if follow:
        calls: Iterator[PrintCall] = follow_print(path, poll_s=poll_s)
    else:
        calls = iter_print(path, strict=not partial)
        size = os.path.getsize(path)
        if not as_json and size >= _PROGRESS_MIN_BYTES and sys.stderr.isatty():
            calls = _with_progress(calls, size)
    out = console()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrintFileWarning)
            _show(calls, out, as_json=as_json, follow=follow)
        for warning in caught:
            err_console().print(f"[yellow]obs: warning:[/] {warning.message}", soft_wrap=True, highlight=False)
    except TruncatedPrintFile as exc:
        error(f"{exc.fact}; `obs print --partial` shows the complete ones")
        return 1
    except PrintFileError as exc:
        error(str(exc))
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _show(calls: Iterator[PrintCall], out: Any, *, as_json: bool, follow: bool) -> None:
    for call in calls:
        if as_json:
            sys.stdout.write(json.dumps(call_to_json(call)) + "\n")
            if follow:
                sys.stdout.flush()
            continue
        out.print(_header(call))
        for value in call.values:
            out.print(_render_value(value))

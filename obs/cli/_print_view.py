"""``obs print FILE``: render a print file (parse_print, pretty), follow a live one, or emit JSON lines.

Memory stays bounded by a small multiple of the largest record: calls are streamed, large tensors
are written to JSON in slices, human output summarizes large tensors (numpy's threshold), and an
empty tensor whose nested lists would outnumber a bound is written as ``[]`` (its ``shape`` says
the rest).  Text from the file is escaped (:func:`~obs.cli._render.clean`) before it reaches a terminal.
"""

from __future__ import annotations

import errno
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

from obs.cli._render import clean, console, err_console, error, warning
from printsink.dtypes import NAME_OF_NUMPY
from printsink.reader import PrintCall, PrintFileError, PrintFileWarning, TruncatedPrintFile, follow_print, iter_print
from printsink.screen import format_array

__all__ = ["call_json_text", "run_print"]

_PROGRESS_MIN_BYTES = 16 << 20
_SLICE = 1 << 16  # elements converted to JSON at a time
_MAX_EMPTY_LISTS = 1 << 16


def _dtype_name(array: np.ndarray) -> str:
    return NAME_OF_NUMPY.get(array.dtype.newbyteorder("="), str(array.dtype))


def _json_number(x: Any) -> Any:
    if isinstance(x, complex):
        return [_json_number(x.real), _json_number(x.imag)]
    if isinstance(x, float) and not np.isfinite(x):
        return "nan" if np.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _plain(value: np.ndarray) -> Any:
    """A small array (or 0-d) as JSON-able lists of numbers."""
    data = value.tolist()
    if value.dtype.kind in "fc" and (value.dtype.kind == "c" or not np.isfinite(value).all()):
        data = np.vectorize(_json_number, otypes=[object])(value).tolist() if value.size else data
    return data


def _empty_lists(shape: tuple[int, ...]) -> int:
    count = total = 1
    for d in shape[:-1]:
        count *= d
        total += count
        if not count:
            break
    return total


def _array_text(value: np.ndarray) -> Iterator[str]:
    """The JSON text of an array's nested lists, in pieces of about ``_SLICE`` elements."""
    if value.size <= _SLICE:
        if value.size == 0 and _empty_lists(value.shape) > _MAX_EMPTY_LISTS:
            yield "[]"
        else:
            yield json.dumps(_plain(value))
        return
    rows = max(1, _SLICE // (value[0].size or 1))
    yield "["
    for i in range(0, value.shape[0], rows):
        if i:
            yield ", "
        if value.ndim == 1:
            yield json.dumps(_plain(value[i:i + rows]))[1:-1]
        elif rows == 1:
            yield from _array_text(value[i])
        else:
            yield json.dumps(_plain(value[i:i + rows]))[1:-1]
    yield "]"


def _value_text(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield json.dumps({"type": "str", "value": value})
        return
    head = {"type": "tensor", "dtype": _dtype_name(value), "shape": list(value.shape)}
    yield json.dumps(head)[:-1] + ', "value": '
    yield from _array_text(value)
    yield "}"


def _meta_json(call: PrintCall) -> dict[str, Any]:
    out: dict[str, Any] = {"offset": call.offset}
    if call.meta is not None:
        m = call.meta
        out.update(seq=m.seq, time_ns=m.time_ns, step=m.step, rank=m.rank, pid=m.pid, source=m.source)
        if m.parent_pid:
            out.update(parent_pid=m.parent_pid, worker=m.pid != m.parent_pid)
    return out


def call_json_text(call: PrintCall) -> Iterator[str]:
    """One call as one line of JSON, in pieces (large tensors never become one huge Python list)."""
    yield json.dumps(_meta_json(call))[:-1] + ', "values": ['
    for i, value in enumerate(call.values):
        if i:
            yield ", "
        yield from _value_text(value)
    yield "]}\n"


def _header(call: PrintCall) -> Text:
    m = call.meta
    if m is None:
        return Text(f"@{call.offset}", style="dim")
    stamp = time.strftime("%H:%M:%S", time.localtime(m.time_ns / 1e9)) + f".{m.time_ns // 1_000_000 % 1000:03d}"
    who = f"pid {m.pid}"
    if m.parent_pid and m.pid != m.parent_pid:
        who = f"worker pid {m.pid} (of {m.parent_pid}; step as of its start)"
    return Text(f"#{m.seq}  step {m.step}  rank {m.rank}  {who}  {stamp}  {clean(m.source, newlines=False)}",
                style="dim cyan")


def _render_value(value: Any) -> Text:
    if isinstance(value, str):
        return Text(clean(value))
    return Text(format_array(value, _dtype_name(value)), style="green" if value.ndim == 0 else "")


def _with_progress(calls: Iterator[PrintCall], size: int) -> Iterator[PrintCall]:
    columns = (TextColumn("reading"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=err_console(), transient=True) as progress:
        task = progress.add_task("read", total=size)
        for call in calls:
            progress.update(task, completed=call.end)
            yield call


def run_print(path: str, *, follow: bool, as_json: bool, partial: bool, poll_s: float = 0.25) -> int:
    """Exit 0 when every record read; 1 for a damaged print file (``--partial``: 0, with a warning saying
    what was skipped); a file that is not a print file, or is missing, raises (the CLI exits 2)."""
    if follow:
        if not os.path.lexists(path):
            warning(f"{path} does not exist yet: waiting for it (a job creates its print file on its first Print)")
        calls: Iterator[PrintCall] = follow_print(path, poll_s=poll_s, wait=True)
    else:
        calls = iter_print(path, strict=not partial)
        size = os.path.getsize(path)
        if not as_json and size >= _PROGRESS_MIN_BYTES and sys.stderr.isatty():
            calls = _with_progress(calls, size)
    out = console()
    out.on_broken_pipe = _reraise_broken_pipe  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrintFileWarning)
            _show(calls, out, as_json=as_json, follow=follow)
        for caught_warning in caught:
            warning(str(caught_warning.message))
    except TruncatedPrintFile as exc:
        error(f"{exc.fact}; `obs print --partial` shows the complete ones")
        return 1
    except PrintFileError as exc:
        error(f"{exc}; `obs print --partial` skips damaged records and shows the intact ones")
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _reraise_broken_pipe() -> None:
    """rich ends the process with exit 1 on a closed pipe; obs's main() ends it quietly with 0 instead."""
    raise BrokenPipeError(errno.EPIPE, "the reader closed the pipe")


def _show(calls: Iterator[PrintCall], out: Any, *, as_json: bool, follow: bool) -> None:
    write = sys.stdout.write
    for call in calls:
        if as_json:
            for piece in call_json_text(call):
                write(piece)
            if follow:
                sys.stdout.flush()
            continue
        out.print(_header(call))
        for value in call.values:
            out.print(_render_value(value))
    sys.stdout.flush()

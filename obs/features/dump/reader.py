"""Reading a data dump (MindSpore's layout): steps × ops × tensors and statistics, for notebooks and the CLI.

``DumpReader(path)`` takes the dump's ``path`` (the folder of ``rank_*``), a rank folder, or one
iteration folder.  Like MindInsight's ``DumpAnalyzer`` it lists and selects; it never loads a tensor
until asked (:meth:`TensorFile.load`).  Pure: files in, dataclasses and numpy arrays out; files are
opened without following symlinks (:mod:`obs._core.safe_files`), ``.npy`` files never unpickle.

Two numberings meet here: a data dump numbers its steps by *iteration* (its folders; the first step is
``initial_iteration``, 0 by default), while obs's other records (the RDR, Print, the NaN check, the
exception dump, the profiler) number them from 1 (``obs.runtime.steps``).  The data dump writes
iteration ``initial_iteration + step - 1`` (:mod:`obs.features.dump.data_dump`): :attr:`Step.training_step`
and :attr:`FaultFolder.iteration` give the other number, from the ``initial_iteration`` of the rank's
``.dump_metadata/data_dump.json``.

Errors: a folder with no dump in it is :class:`NotOurFileError`; a damaged ``statistic.csv`` or
``.npy`` is :class:`DamagedFileError` naming the file and the byte offset.
"""

from __future__ import annotations

import csv
import io
import operator
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError
from obs._core.json_files import read_json
from obs.features.dump.stats.columns import FIXED_COLUMNS
from obs.settings.dump_config import CATEGORY_COLUMNS

__all__ = ["Capture", "DumpReader", "FaultFolder", "StatRow", "Step", "TensorFile", "TensorKey", "initial_iteration",
           "load_npy", "parse_tensor_name", "read_statistic_csv", "read_statistic_fields"]

_MAX_CSV = 1 << 30  # a statistic.csv larger than this is not one of ours
_COLUMN_KEYS = {column: key for key, column in reversed(CATEGORY_COLUMNS.items())}
_COLUMN_KEYS.update({"NaN Count": "nan count", "Nan Count": "nan count", "L2 Value": "l2norm"})


@dataclass(frozen=True)
class Step:
    """One iteration folder: ``{path}/rank_{rank}/{net}/{graph}/{iteration}``.

    ``training_step``: the step's number in obs's other records (the RDR, Print, the NaN check, the profiler),
    ``iteration - initial_iteration + 1``; None where the rank's ``.dump_metadata/data_dump.json`` is missing or
    unreadable.
    """

    rank: int
    net: str
    graph: int
    iteration: int
    path: str
    training_step: int | None = None


@dataclass(frozen=True)
class TensorKey:
    """What names one dumped tensor, in a file name and in a statistic.csv row alike."""

    op_type: str
    op_name: str
    task_id: int
    stream_id: int
    timestamp: int
    io: str
    slot: int


@dataclass(frozen=True)
class TensorFile(TensorKey):
    """One dumped tensor, from its file name (nothing read yet)."""

    format: str = "DefaultFormat"
    dtype: str = ""
    path: str = ""
    step: Step | None = None

    def load(self) -> np.ndarray:
        """The array (opened without following symlinks; no pickles; the header must match the file's size)."""
        return load_npy(self.path)


def load_npy(path: str) -> np.ndarray:
    """A ``.npy`` file's array, checked before anything is allocated: a header that promises more (or less) data
    than the file holds, an object dtype or a bad header is :class:`DamagedFileError` with the byte offset."""
    data = safe_files.read_private(path)
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except Exception as exc:  # noqa: BLE001 - numpy's header parser raises ValueError, SyntaxError, tokenize errors
        raise DamagedFileError(f"{path}: not a readable .npy header ({exc})", path=path, offset=0) from None
    start = stream.tell()
    if dtype.hasobject or dtype.itemsize == 0:
        raise DamagedFileError(f"{path}: .npy dtype {dtype} holds no plain data", path=path, offset=start)
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != len(data) - start:
        raise DamagedFileError(f"{path}: the header at byte 0 promises {count * dtype.itemsize} bytes of "
                               f"{dtype} {shape} but {len(data) - start} follow it (byte offset {start})", path=path,
                               offset=start)
    array = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return array.reshape(shape, order="F" if fortran else "C")


@dataclass(frozen=True)
class StatRow(TensorKey):
    """One row of ``statistic.csv``; ``stats`` maps the category (``"max"``, ``"l2norm"``) to its value."""

    data_size: int = 0
    data_type: str = ""
    shape: tuple[int, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)
    step: Step | None = None


@dataclass(frozen=True)
class FaultFolder:
    """One exception_dump / nan_check folder and its ``meta.json``.

    ``rank``: of its ``rank_<r>`` folder.  ``iteration``: the data dump's number of the folder's step (its
    ``meta["step"]``, counted from 1), where the same rank folder holds a data dump (``initial_iteration + step -
    1``); None elsewhere.
    """

    kind: str
    path: str
    meta: dict[str, Any]
    rank: int = 0
    iteration: int | None = None


Capture = FaultFolder  #: the name :class:`FaultFolder` had before, kept

_NAME = re.compile(r"([^.]+)\.([^.]+)\.(\d+)\.(\d+)\.(\d+)\.(input|output)\.(\d+)\.([^.]+)\.([^.]+)\.npy")


def parse_tensor_name(name: str) -> tuple[str, str, int, int, int, str, int, str, str] | None:
    """The fields of a tensor file name ``{type}.{name}.{task}.{stream}.{us}.{io}.{slot}.{format}.{dtype}.npy``."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    g = m.groups()
    return g[0], g[1], int(g[2]), int(g[3]), int(g[4]), g[5], int(g[6]), g[7], g[8]


def _value(text: str) -> Any:
    if text == "null" or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text  # MD5 / SHA1


def _statistic_text(path: str) -> tuple[list[str], str, str]:
    """A ``statistic.csv``'s statistic keys (``"max"``, ``"l2norm"``), its header line and the text below it."""
    data = safe_files.read_private(path, limit=_MAX_CSV + 1)
    if len(data) > _MAX_CSV:
        raise NotOurFileError(f"{path}: larger than {_MAX_CSV} bytes; not a statistic.csv obs reads", path=path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"{path}: not UTF-8 text at byte offset {exc.start}", path=path,
                               offset=exc.start) from None
    header, _, body = text.partition("\n")
    columns = header.rstrip("\r").split(",")
    if tuple(columns[:10]) != FIXED_COLUMNS:
        raise NotOurFileError(f"{path}: not a statistic.csv (its first line is not the 10 fixed columns "
                              f"{','.join(FIXED_COLUMNS)})", path=path)
    extra = columns[10:]
    unknown = [c for c in extra if c not in _COLUMN_KEYS]
    if unknown:
        raise DamagedFileError(f"{path}: unknown statistic column {unknown[0]!r} in the header", path=path, offset=0)
    return [_COLUMN_KEYS[c] for c in extra], header, body


def read_statistic_fields(path: str) -> tuple[list[str], list[list[str]]]:
    """A ``statistic.csv`` unparsed, for readers of many rows (``obs dump diff``): its statistic keys, and each row's
    fields as text (the 10 fixed columns, then the statistics in the keys' order).  The header and each row's
    number of fields, IO and slot are checked as :func:`read_statistic_csv` checks them, with the same errors."""
    keys, _, body = _statistic_text(path)
    width = 10 + len(keys)
    rows = [fields for fields in csv.reader(io.StringIO(body, newline="")) if fields]  # blank lines: no fields
    if any(len(fields) != width or fields[5] not in ("input", "output") or not fields[6].isdigit() for fields in rows):
        read_statistic_csv(path)  # raises DamagedFileError with the bad row's byte offset
        raise DamagedFileError(f"{path}: a quoted field runs across lines", path=path, offset=0)
    return keys, rows


def read_statistic_csv(path: str, step: Step | None = None) -> list[StatRow]:
    """The rows of one ``statistic.csv``; a file that is not one is NotOurFileError, a bad row DamagedFileError."""
    keys, header, body = _statistic_text(path)
    rows: list[StatRow] = []
    offset = len(header) + 1
    for line in body.splitlines(keepends=True):
        start, offset = offset, offset + len(line.encode("utf-8"))
        if not line.strip():
            continue
        try:
            fields = next(csv.reader([line]))
            if len(fields) != 10 + len(keys):
                raise ValueError(f"{len(fields)} fields where the header has {10 + len(keys)}")
            shape_text = fields[9].strip()
            if not (shape_text.startswith("(") and shape_text.endswith(")")):
                raise ValueError(f"shape {shape_text!r} is not like (2,3)")
            inner = shape_text[1:-1].strip().rstrip(",")
            shape = tuple(int(d) for d in inner.split(",")) if inner else ()
            if fields[5] not in ("input", "output"):
                raise ValueError(f"IO {fields[5]!r} is neither input nor output")
            rows.append(StatRow(fields[0], fields[1], int(fields[2]), int(fields[3]), int(fields[4]), fields[5],
                                int(fields[6]), int(fields[7]), fields[8], shape,
                                {k: _value(v) for k, v in zip(keys, fields[10:])}, step))
        except (ValueError, csv.Error) as exc:
            raise DamagedFileError(f"{path}: bad row at byte offset {start}: {exc}", path=path,
                                   offset=start) from None
    return rows


def initial_iteration(rank_dir: str) -> int | None:
    """The ``initial_iteration`` of the data dump in ``rank_dir`` (from ``.dump_metadata/data_dump.json``; 0 when
    the JSON leaves it out, as MindSpore's default); None where there is no such file or it is not readable."""
    path = os.path.join(rank_dir, ".dump_metadata", "data_dump.json")
    try:
        data = read_json(path, what="the data dump's config", limit=1 << 20)
    except (OSError, ValueError):  # absent, unreadable, not JSON
        return None
    common = data.get("common_dump_settings")
    value = common.get("initial_iteration", 0) if isinstance(common, dict) else None
    return value if type(value) is int and value >= 0 else None


def _int_dirs(path: str) -> list[tuple[int, str]]:
    out = []
    try:
        names = os.listdir(path)
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return []
    for name in names:
        full = os.path.join(path, name)
        if name.isdigit() and os.path.isdir(full) and not os.path.islink(full):
            out.append((int(name), full))
    return sorted(out)


class DumpReader:
    """Iterates a dump: :meth:`steps`, :meth:`tensors`, :meth:`statistics`, :meth:`select`, :meth:`fault_folders`."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{path}: no such folder")
        self._initial: dict[str, int | None] = {}  # rank folder → its data dump's initial_iteration
        self._steps = self._find_steps()
        self._faults = self._find_fault_folders()
        if not self._steps and not self._faults:
            raise NotOurFileError(f"{path}: no data dump here (no rank_*/NET/GRAPH/ITERATION folders, "
                                  "no exception_dump or nan_check folders)", path=path)

    # -- layout -------------------------------------------------------------------------------
    def _rank_dirs(self) -> list[tuple[int, str]]:
        base = os.path.basename(self.path)
        if re.fullmatch(r"rank_\d+", base):
            return [(int(base[5:]), self.path)]
        out = []
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if re.fullmatch(r"rank_\d+", name) and os.path.isdir(full) and not os.path.islink(full):
                out.append((int(name[5:]), full))
        return out

    def _step(self, rank: int, rank_dir: str, net: str, graph: int, iteration: int, path: str) -> Step:
        if rank_dir not in self._initial:
            self._initial[rank_dir] = initial_iteration(rank_dir)
        first = self._initial[rank_dir]
        return Step(rank, net, graph, iteration, path, None if first is None else iteration - first + 1)

    def _find_steps(self) -> list[Step]:
        # One iteration folder given directly: {..}/rank_r/net/graph/iteration
        parts = self.path.split(os.sep)
        if len(parts) >= 4 and parts[-1].isdigit() and parts[-2].isdigit() and re.fullmatch(r"rank_\d+", parts[-4]):
            return [self._step(int(parts[-4][5:]), os.sep.join(parts[:-3]), parts[-3], int(parts[-2]),
                               int(parts[-1]), self.path)]
        steps = []
        for rank, rank_dir in self._rank_dirs():
            for net in sorted(os.listdir(rank_dir)):
                net_dir = os.path.join(rank_dir, net)
                if net.startswith(".") or net in ("execution_order", "graphs", "exception_dump", "nan_check") or \
                        not os.path.isdir(net_dir) or os.path.islink(net_dir):
                    continue
                for graph, graph_dir in _int_dirs(net_dir):
                    for iteration, step_dir in _int_dirs(graph_dir):
                        steps.append(self._step(rank, rank_dir, net, graph, iteration, step_dir))
        return steps

    def _find_fault_folders(self) -> list[FaultFolder]:
        out = []
        for rank, rank_dir in self._rank_dirs():
            # the data dump's numbering, where one of this rank is listed too
            first = self._initial.get(rank_dir)
            for kind in ("exception_dump", "nan_check"):
                folder = os.path.join(rank_dir, kind)
                if not os.path.isdir(folder):
                    continue
                for name in sorted(os.listdir(folder)):
                    meta_path = os.path.join(folder, name, "meta.json")
                    if name.startswith(".") or not os.path.isfile(meta_path):
                        continue
                    try:
                        meta = read_json(meta_path, what="a capture's meta.json")
                    except (ValueError, OSError):
                        meta = {"unreadable": True}
                    step = meta.get("step")
                    iteration = first + step - 1 if first is not None and type(step) is int and step > 0 else None
                    out.append(FaultFolder(kind, os.path.join(folder, name), meta, rank, iteration))
        return out

    # -- listing ------------------------------------------------------------------------------
    def steps(self, *, rank: int | None = None, net: str | None = None) -> list[Step]:
        return [s for s in self._steps if (rank is None or s.rank == rank) and (net is None or s.net == net)]

    def iterations(self) -> list[int]:
        return sorted({s.iteration for s in self._steps})

    def fault_folders(self) -> list[FaultFolder]:
        """exception_dump and nan_check folders, oldest first per kind."""
        return list(self._faults)

    captures = fault_folders  #: the name :meth:`fault_folders` had before, kept

    def _steps_of(self, step: Step | int | None) -> list[Step]:
        """The steps ``step`` names: itself (a :class:`Step`), every folder of that iteration (all ranks and nets),
        or all (None)."""
        if step is None:
            return self._steps
        if isinstance(step, Step):
            return [step]
        if isinstance(step, bool) or not hasattr(type(step), "__index__"):  # an int or a numpy integer, not True
            raise TypeError(f"step must be a Step (from steps()), an iteration number (from iterations()) or None, "
                            f"not {step!r}")
        iteration = operator.index(step)
        found = [s for s in self._steps if s.iteration == iteration]
        if not found:
            have = self.iterations()
            raise ValueError(f"no iteration {iteration} in {self.path}: " +
                             (f"its iterations are {have}" if have else "it holds no iteration folder"))
        return found

    def tensors(self, step: Step | int | None = None) -> Iterator[TensorFile]:
        """Tensor files of one step (a :class:`Step`, or an iteration number: its folders of every rank), or of all,
        in the order they were written (their timestamps).  An iteration that is not there raises ValueError
        naming those that are, at the call."""
        return self._tensors(self._steps_of(step))

    def _tensors(self, steps: list[Step]) -> Iterator[TensorFile]:
        for s in steps:
            found = []
            for name in os.listdir(s.path):
                fields = parse_tensor_name(name)
                if fields is not None:
                    found.append(TensorFile(*fields, path=os.path.join(s.path, name), step=s))
            yield from sorted(found, key=lambda t: (t.timestamp, t.io, t.slot))

    def statistics(self, step: Step | int | None = None) -> Iterator[StatRow]:
        """Rows of ``statistic.csv`` of one step (a :class:`Step` or an iteration number, as :meth:`tensors`), or
        of all, in execution order."""
        return self._statistics(self._steps_of(step))

    def _statistics(self, steps: list[Step]) -> Iterator[StatRow]:
        for s in steps:
            path = os.path.join(s.path, "statistic.csv")
            if os.path.exists(path):
                yield from read_statistic_csv(path, s)

    def select(self, query: str = "", *, use_regex: bool = True, iterations: list[int] | None = None,
               ranks: list[int] | None = None, slots: list[int] | None = None,
               io: str | None = None) -> list[TensorFile]:
        """Tensors whose op name matches ``query`` (a regex, or a substring), like DumpAnalyzer.select_tensors."""
        pattern = re.compile(query) if use_regex and query else None
        out = []
        for s in self._steps:
            if (iterations is not None and s.iteration not in iterations) or \
                    (ranks is not None and s.rank not in ranks):
                continue
            for t in self.tensors(s):
                name_ok = pattern.search(t.op_name) if pattern else query in t.op_name
                if name_ok and (slots is None or t.slot in slots) and (io is None or t.io == io):
                    out.append(t)
        return out

    def execution_order(self, rank: int = 0, graph: int = 0) -> list[str]:
        """Op full names of the last dumped step, in execution order (``execution_order/``)."""
        for r, rank_dir in self._rank_dirs():
            if r == rank:
                path = os.path.join(rank_dir, "execution_order", f"ms_execution_order_graph_{graph}.csv")
                if os.path.exists(path):
                    lines = safe_files.read_private(path).decode("utf-8", "replace").splitlines()
                    return lines[1:]
        return []

"""Requests to the ranks of a running job: a folder any process drops a request into, each rank's watcher answers.

Plain files in ``{root}/requests/`` (``root``: the RDR root, the folder of the ``rank_{r}/rdr`` trees), so that it
works across nodes when the root is on shared storage: no signal, no socket, no inotify (NFS has none).

* A request is ``{kind}-{id}.json``: ``{"kind", "id", "created_ns", "asked_by", "params", "host", "pid"}``.
  ``kind`` names what is asked (``snapshot``: a bundle now, the job goes on; ``capture``: the profiler's detail for
  the next N steps, in the profiler's output folder); ``id`` is 16 random hex digits;
  ``asked_by`` is ``cli`` or ``rank N`` (a rank whose hang watchdog fired); ``params`` is the kind's own.
* Each rank answers with ``{kind}-{id}.rank_{r}.json`` beside it: ``{"request", "kind", "rank", "host", "pid",
  "answered_ns"}`` plus what its handler returned (the bundle's path, or an ``error``).
* Every file is written under a temporary name (a dot name, which no watcher reads) and renamed into place, through
  :mod:`obs._core.safe_files`: the folder 0700, files 0600, never through a symlink; a file is read only when it is
  a regular file of this user, of at most :data:`MAX_BYTES`.

A :class:`RequestWatcher` (one daemon thread per recorder, ``obs-rdr-requests``) lists the folder every
:data:`POLL_S` seconds and hands each request to the handler of its kind, once per process.  It leaves alone: the
requests made before it started or more than :data:`MAX_AGE_S` old, those of a kind it has no handler for (a
newer obs's), and its own process's (ages are read on wall clocks: hosts' clocks must agree within seconds).  A
request file it cannot read (a symlink, not JSON, too large, another user's) is skipped with a report
(:func:`~obs._core.internal.report_internal_error`), once; nothing it meets is raised into the training loop.

Requests are removed by whoever made them, with their answers (:func:`remove_request`): the CLI when it stops
waiting, a rank that asked on a hang when its recorder stops.  A request left behind (an asker killed first, a rank
that aborted on its hang) stays a small file: the recorders that saw it answered it once, one started after it
ignores it, and every recorder ignores it once it is :data:`MAX_AGE_S` old.  Deleting the folder is always safe.
An answer that comes after its request was removed is not written.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError
from obs._core.internal import report_internal_error
from obs._core.json_files import is_int, read_json
from recorder.bundle_reader import BAD_FILE

__all__ = ["MAX_AGE_S", "MAX_BYTES", "POLL_S", "REQUESTS", "Handler", "Request", "RequestWatcher", "answer_path", "ask",
           "make_request", "read_answers", "read_request", "remove_request", "request_path", "requests_dir",
           "write_answer", "write_request"]

REQUESTS = "requests"  #: the folder's name under the RDR root
POLL_S = 0.5  #: how often a watcher lists the folder
MAX_AGE_S = 300.0  #: a request older than this is never answered
MAX_BYTES = 64 * 1024  #: a request or an answer larger than this is not ours
_STOP_WAIT_S = 10.0  # a stop waits this long for a handler under way (a dump), then lets the daemon thread be

_KIND = r"[a-z][a-z_]{0,31}"
_ID = r"[0-9a-f]{8,32}"
_REQUEST = re.compile(rf"({_KIND})-({_ID})\.json")
_ANSWER = re.compile(rf"({_KIND})-({_ID})\.rank_(\d{{1,6}})\.json")

#: a kind's handler: runs on the watcher's thread, returns what the answer says (JSON-able), never blocks for long
Handler = Callable[["Request"], dict[str, Any]]


@dataclass(frozen=True)
class Request:
    """One request: what is asked (``kind``, ``params``), by whom, when, from which process."""

    kind: str
    id: str
    created_ns: int
    asked_by: str
    params: dict[str, Any] = field(default_factory=dict)
    host: str = ""
    pid: int = 0

    @property
    def name(self) -> str:
        """``{kind}-{id}``: the file names' stem."""
        return f"{self.kind}-{self.id}"


def requests_dir(root: str) -> str:
    """``{root}/requests`` (an empty root is the current folder, as for ``rank_{r}/rdr``)."""
    return os.path.join(root or os.getcwd(), REQUESTS)


def request_path(folder: str, request: Request) -> str:
    return os.path.join(folder, f"{request.name}.json")


def answer_path(folder: str, request: Request, rank: int) -> str:
    return os.path.join(folder, f"{request.name}.rank_{rank}.json")


def make_request(kind: str, *, asked_by: str, params: Mapping[str, Any] | None = None) -> Request:
    """A new request of ``kind`` (a fresh random id, created now, by this process)."""
    if not re.fullmatch(_KIND, kind):
        raise ValueError(f"a request kind is lowercase letters and _ (got {kind!r})")
    return Request(kind, secrets.token_hex(8), time.time_ns(), asked_by, dict(params or {}), socket.gethostname(),
                   os.getpid())


def write_request(root: str, request: Request) -> str:
    """Drop ``request`` into ``root``'s request folder (created 0700 when missing); returns the file's path."""
    folder = safe_files.ensure_dir(requests_dir(root))
    path = request_path(folder, request)
    safe_files.write_atomic(path, json.dumps(asdict(request), indent=2, default=str), fsync=False)
    return path


def read_request(path: str) -> Request:
    """The request in ``path``; :class:`NotOurFileError` / :class:`DamagedFileError` / :class:`UnsafePathError`
    (an ``OSError``) when it is not one."""
    found = _REQUEST.fullmatch(os.path.basename(path))
    data = read_json(path, what="a request", limit=MAX_BYTES)
    if found is None:
        raise NotOurFileError(f"{path}: not a request (a JSON object in a file named KIND-ID.json)", path=path)
    kind, rid = found.groups()
    created, asked_by = data.get("created_ns"), data.get("asked_by")
    params, host, pid = data.get("params", {}), data.get("host", ""), data.get("pid", 0)
    if (data.get("kind"), data.get("id")) != (kind, rid) or not is_int(created) or not isinstance(asked_by, str) \
            or not isinstance(params, dict) or not isinstance(host, str) or not is_int(pid):
        raise DamagedFileError(f"{path}: not a request: kind and id must match the file's name, created_ns and pid "
                               "be whole numbers, asked_by and host strings, params an object", path=path, offset=0)
    return Request(kind, rid, created, asked_by, params, host, pid)


def write_answer(folder: str, request: Request, rank: int, answer: Mapping[str, Any]) -> str | None:
    """Answer ``request`` as ``rank``; returns the answer's path, or None when the request is gone (its asker
    stopped waiting: the folder is not made again)."""
    if not os.path.lexists(request_path(folder, request)):
        return None
    data = {"request": request.id, "kind": request.kind, "rank": rank, "host": socket.gethostname(),
            "pid": os.getpid(), "answered_ns": time.time_ns(), **answer}
    path = answer_path(folder, request, rank)
    try:  # in the asker's folder, as it is: never made again
        safe_files.write_atomic(path, json.dumps(data, indent=2, default=str), fsync=False, folder_ready=True)
    except FileNotFoundError:  # the asker removed the folder in between
        return None
    return path


def read_answers(folder: str, request: Request) -> tuple[dict[int, dict[str, Any]], list[Exception]]:
    """The answers to ``request`` so far, by rank, and the answer files that could not be read."""
    answers: dict[int, dict[str, Any]] = {}
    problems: list[Exception] = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return answers, problems
    for name in names:
        found = _ANSWER.fullmatch(name)
        if found is None or found.group(2) != request.id or found.group(1) != request.kind:
            continue
        path = os.path.join(folder, name)
        try:
            data = read_json(path, what="an answer", limit=MAX_BYTES)
        except BAD_FILE as exc:
            problems.append(exc)
            continue
        answers[int(found.group(3))] = data
    return answers, problems


def remove_request(folder: str, request: Request) -> None:
    """Remove ``request`` and its answers, then the folder if nothing else is left in it."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if name == f"{request.name}.json" or (name.startswith(f"{request.name}.rank_") and _ANSWER.fullmatch(name)):
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass
    try:
        os.rmdir(folder)
    except OSError:  # not empty (another request, a late answer), or gone
        pass


def ask(roots: Iterable[str], kind: str, expected: Collection[tuple[str, int, int]], *, timeout: float,
        params: Mapping[str, Any] | None = None, poll_s: float = 0.1) \
        -> tuple[dict[str, Request], dict[tuple[str, int, int], dict[str, Any]], float]:
    """Drop one ``kind`` request into each of ``roots`` and wait up to ``timeout`` s until every ``expected``
    (root, rank, pid) answered; the requests (and their answers) are removed before it returns.

    Returns the requests by root, the answers by (root, rank, pid) and the seconds waited."""
    started = time.monotonic()
    requests: dict[str, Request] = {}
    answers: dict[tuple[str, int, int], dict[str, Any]] = {}
    try:
        for root in sorted(set(roots)):
            requests[root] = make_request(kind, asked_by="cli", params=params)
            write_request(root, requests[root])
        deadline = started + timeout
        while True:
            for root, request in requests.items():
                found, _problems = read_answers(requests_dir(root), request)  # a bad file is read again, then missing
                for rank, answer in found.items():
                    pid = answer.get("pid")
                    answers[(root, rank, pid if is_int(pid) else -1)] = answer
            if all(key in answers for key in expected) or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
    finally:
        for root, request in requests.items():
            remove_request(requests_dir(root), request)
    return requests, answers, round(time.monotonic() - started, 3)


class RequestWatcher:
    """Watches one request folder and hands each new request to the handler of its kind (see the module's
    docstring for what it leaves alone).  ``rank`` gives the rank to answer as (it may be resolved later); ``name``
    is its thread's (the profiler's watcher, on its output folder, answers ``capture`` requests)."""

    def __init__(self, root: str, handlers: Mapping[str, Handler], *, rank: Callable[[], int],
                 interval: float = POLL_S, max_age_s: float = MAX_AGE_S, started_ns: int | None = None,
                 name: str = "obs-rdr-requests") -> None:
        self.folder = requests_dir(root)
        self.handlers = dict(handlers)
        self.started_ns = time.time_ns() if started_ns is None else started_ns
        self._rank, self._name = rank, name
        self._interval, self._max_age_ns = interval, int(max_age_s * 1e9)
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._seen: set[str] = set()  # file names handled or left alone: each once per process
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> RequestWatcher:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = _STOP_WAIT_S) -> None:
        """Stop the thread and wait for it (at most ``timeout``: a handler under way, a dump, finishes alone)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            if thread is not threading.current_thread():
                thread.join(timeout)

    def detach(self) -> None:
        """In a forked child: the thread did not survive the fork; forget it without touching the folder."""
        self._thread = None
        self._seen = set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ignore(self, request: Request) -> None:
        """Never hand ``request`` to a handler here (one this process made)."""
        self._seen.add(f"{request.name}.json")

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a bug of ours must not end the job (raised in tests)
                report_internal_error("rdr requests watcher", exc)

    # -- one look at the folder -----------------------------------------------------------------
    def poll(self) -> list[str]:
        """List the folder once and handle what is new; returns the names of the requests handled."""
        try:
            names = [e.name for e in os.scandir(self.folder) if _REQUEST.fullmatch(e.name)]
        except (FileNotFoundError, NotADirectoryError):
            self._seen.clear()
            return []
        self._seen &= set(names)  # a removed request never comes back (ids are random): forget it
        handled = []
        for name in sorted(names):
            if name in self._seen or self._stop.is_set():
                continue
            self._seen.add(name)
            kind = name.split("-", 1)[0]
            if kind not in self.handlers:  # a kind of a newer obs, or of another tool: not ours to answer
                continue
            path = os.path.join(self.folder, name)
            try:
                request = read_request(path)
            except FileNotFoundError:  # removed by its asker in between
                continue
            except BAD_FILE as exc:
                report_internal_error("rdr requests: a request file that is not one, skipped", exc)
                continue
            if self._leave_alone(request):
                continue
            self._handle(request)
            handled.append(name)
        return handled

    def _leave_alone(self, request: Request) -> bool:
        now = time.time_ns()
        return request.created_ns < self.started_ns or now - request.created_ns > self._max_age_ns \
            or (request.pid, request.host) == (self._pid, self._host)

    def _handle(self, request: Request) -> None:
        failure: Exception | None = None
        try:
            answer = self.handlers[request.kind](request)
        except Exception as exc:  # noqa: BLE001 - answered as an error, then reported
            failure = exc
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            write_answer(self.folder, request, self._rank(), answer)
        except OSError as exc:
            failure = failure or exc
        if failure is not None:
            report_internal_error(f"rdr requests: {request.kind} handler", failure)

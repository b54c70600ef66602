"""Fuzz targets: the RDR's files (ring files, manifests, events.jsonl, stacks and exception records), each
through the Python reader and through ``obs rdr`` (ls, show, events, recover).

Seeds are real: a ring written by :class:`RingWriter` with every kind of event (wrapped rings, an op
that raised, prints, faults), and the bundle :func:`bundle_parts` makes of it with a real exception
and the real stacks of this process.  The string table is made small for the seeds (the reader takes
its size from the header) so that a case costs milliseconds.

A CLI command runs with ``--traceback``: any exception escapes ``main`` and is a finding unless it is
a clear ``DamagedFileError`` / ``NotOurFileError``; exit 1 or 2 is a clean rejection.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from obs._core.errors import DamagedFileError, NotOurFileError
from tests.fuzz import Rejected, Target, cli_exit

_PID = 4242
_CAPACITY = {"step": 8, "module": 24, "op": 24, "memory": 4, "collective": 4, "blob": 6}
_BUNDLE: dict[str, bytes] = {}  #: the intact seed bundle's files (name → bytes), made by the first seeds() call


def _ring_bytes(folder: str, name: str, *, steps: int, fault: bool, wrap: bool) -> bytes:
    import recorder.layout as layout
    from recorder.layout import Kind
    from recorder.ring import RingWriter

    saved, layout.STRINGS_SIZE = layout.STRINGS_SIZE, 2048
    try:
        ring = RingWriter(os.path.join(folder, name), _CAPACITY, pid=_PID, rank=1, world_size=2,
                          meta={"run_id": "fuzz", "host": "h", "granularity": "op", "versions": {"torch": "2"}})
    finally:
        layout.STRINGS_SIZE = saved
    step, module, op = ring.appender("step"), ring.appender("module"), ring.appender("op")
    memory, coll = ring.appender("memory"), ring.appender("collective")
    net, fc = ring.intern("Default/net-Net"), ring.intern("Default/net-Net/fc1-Linear")
    addmm, sig, cpu = ring.intern("addmm"), ring.intern("f32[4, 8], f32[16, 8]"), ring.intern("cpu")
    for n in range(1, steps + 1):
        step(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
        for _ in range(3 if wrap else 1):
            module(Kind.MODULE_ENTER, 0, net, n, 0, 0)
            module(Kind.MODULE_ENTER, 0, fc, n, 0, 0)
            op(Kind.OP, 0, addmm, fc, 1500 + n, sig)
            module(Kind.MODULE_EXIT, 0, fc, n, 0, 0)
            module(Kind.MODULE_EXIT, 0, net, n, 0, 0)
        memory(Kind.MEMORY, 0, cpu, n, n << 20, 2 << 20)
        coll(Kind.COLLECTIVE, 0, ring.intern("all_reduce group=default"), n, 900, 2)
        ring.blob(Kind.PRINT, {"values": ["loss", f"Float32[] {1 / n:.3f}"], "source": "train.py:12"})
        step(Kind.STEP_END, 0, 0, n, 5000 + n, 0)
    if fault:
        step(Kind.STEP_BEGIN, 0, 0, steps + 1, 0, 0)
        module(Kind.MODULE_ENTER, 0, net, steps + 1, 0, 0)
        op(Kind.OP, 1, addmm, net, 10, sig)
        module(Kind.MODULE_EXIT, 1, net, steps + 1, 0, 0)
        ring.blob(Kind.FAULT, {"fault": "module_error", "detail": "Default/net-Net", "error": "ValueError: boom"})
        ring.blob(Kind.MARKER, {"marker": "SIGTERM", "signal": 15})
    data = bytes(ring.buffer())
    ring.close(remove=True)
    return data


def _ring_seeds(scratch: str) -> list[bytes]:
    return [_ring_bytes(scratch, "a.obsring", steps=2, fault=True, wrap=False),
            _ring_bytes(scratch, "b.obsring", steps=4, fault=False, wrap=True),
            _ring_bytes(scratch, "c.obsring", steps=0, fault=False, wrap=False)]


def _raise_first(errors: list[BaseException]) -> None:
    if errors:
        raise errors[0]


# -- ring files ------------------------------------------------------------------------------------
def _read_ring(path: str) -> None:
    from recorder.assemble import bundle_parts
    from recorder.ring_reader import read_ring_file

    contents = read_ring_file(path)
    contents.summary()
    bundle_parts(contents, "fuzz")


def _place_ring(folder: str, data: bytes) -> str:
    """The ring (and a faulthandler file beside it) twice: ``api/`` for the reader, ``cli/`` for the command
    (each recovers, and renames, its own copy)."""
    for copy in ("api", "cli"):
        rdr = os.path.join(folder, copy, "rank_1", "rdr")
        os.makedirs(rdr, 0o700)
        with open(os.path.join(rdr, f"fatal_{_PID}.txt"), "w") as fh:
            fh.write("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n")
        with open(os.path.join(rdr, f"ring_{_PID}.obsring"), "wb") as fh:
            fh.write(data)
    return folder


def _recover(folder: str) -> None:
    """``recover()`` (every problem it reports must be a clear one), then the bundle it made is read whole."""
    from recorder.bundle_reader import list_bundles, load_bundle
    from recorder.recover import recover

    folder = os.path.join(folder, "api")
    _raise_first(list_bundles(folder).damaged)
    result = recover(folder)
    for bundle in result.made:
        try:
            load_bundle(bundle).events()
        except (DamagedFileError, NotOurFileError) as exc:  # recover must never write a bundle it cannot read
            raise AssertionError(f"recover made an unreadable bundle: {exc}") from exc
    _raise_first(result.problems)


def _cli(path: str, mutated: str, commands: tuple[tuple[str, ...], ...]) -> None:
    """One of ``commands`` (``{}`` is ``path``), chosen by the bytes of the ``mutated`` file so that every
    command sees a share of the cases: running all of them on every case costs more than the readers."""
    with open(mutated, "rb") as fh:
        argv = commands[zlib.crc32(fh.read()) % len(commands)]
    cli_exit("--traceback", *(path if a == "{}" else a for a in argv))


def _recover_cli(folder: str) -> None:
    folder = os.path.join(folder, "cli")
    _cli(folder, os.path.join(folder, "rank_1", "rdr", f"ring_{_PID}.obsring"),
         (("rdr", "ls", "{}"), ("rdr", "ls", "{}", "--json"), ("rdr", "recover", "{}", "--json"),
          ("rdr", "recover", "{}")))


# -- bundles ---------------------------------------------------------------------------------------
def _bundle_files(scratch: str) -> dict[str, bytes]:
    """A real bundle (ring contents, a real exception, this process's stacks) as name → bytes."""
    if _BUNDLE:
        return _BUNDLE
    from recorder.assemble import bundle_parts
    from recorder.bundle import write_bundle
    from recorder.ring_reader import read_ring
    from recorder.stacks import all_stacks

    contents = read_ring(_ring_bytes(scratch, "seed.obsring", steps=3, fault=True, wrap=False))
    try:
        {}["missing"]
    except KeyError as exc:
        error = exc
    manifest, files = bundle_parts(contents, "module_error", error=error, threads=all_stacks(),
                                   fault={"kind": "module_error", "where": "Default/net-Net"},
                                   fatal_stacks="Fatal Python error: Aborted\n", graphs=[("net", "graph()\n")])
    path = write_bundle(os.path.join(scratch, "bundles"), "seed", manifest, files, fsync=False)
    for root, _dirs, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as fh:
                _BUNDLE[os.path.relpath(os.path.join(root, name), path)] = fh.read()
    return _BUNDLE


def _place_bundle(file: str):  # noqa: ANN202 - a place() for one mutated file of the bundle
    def place(folder: str, data: bytes) -> str:
        bundle = os.path.join(folder, "rank_1", "rdr", "20260101T000000.000000Z_4242_module_error")
        os.makedirs(os.path.join(bundle, "graphs"), 0o700)
        for name, content in _BUNDLE.items():
            with open(os.path.join(bundle, name), "wb") as fh:
                fh.write(data if name == file else content)
        return bundle

    return place


def _seeds_of(file: str, extra: tuple[bytes, ...] = ()):  # noqa: ANN202
    def seeds(scratch: str) -> list[bytes]:
        return [_bundle_files(scratch)[file], *extra]

    return seeds


def _read_bundle(path: str) -> None:
    from recorder.bundle_reader import list_bundles, load_bundle

    root = os.path.dirname(os.path.dirname(os.path.dirname(path)))
    _raise_first(list_bundles(root).damaged)
    b = load_bundle(path)
    b.events(last=5)
    b.events({"op", "print"}, step=2)


def _bundle_cli(file: str):  # noqa: ANN202 - obs rdr show / events / ls on a bundle whose ``file`` is mutated
    def read(path: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(path)))
        commands = (("rdr", "show", "{}", "--last", "8"), ("rdr", "show", "{}", "--json"),
                    ("rdr", "events", "{}", "--json"), ("rdr", "events", "{}", "--step", "2"),
                    ("rdr", "show", "{}", "--all-threads"), ("rdr", "ls", root))
        _cli(path, os.path.join(path, file), commands)

    return read


def _both(api: Any, cli: Any):  # noqa: ANN202 - the reader API, then the CLI on the same input
    def read(path: str) -> None:
        errors: list[BaseException] = []
        for reader in (api, cli):
            try:
                reader(path)
            except (Rejected, DamagedFileError, NotOurFileError) as exc:
                errors.append(exc)
        _raise_first(errors)

    return read


def _either(api: Any, cli: Any, mutated: str):  # noqa: ANN202 - the API or the CLI, chosen by the input
    """Recovering writes a bundle (fsynced): one of the two per case keeps the CI run to seconds."""
    def read(path: str) -> None:
        with open(os.path.join(path, mutated), "rb") as fh:
            data = fh.read()
        (api if zlib.adler32(data) & 1 else cli)(path)

    return read


_DEEP = b"[" * 3000 + b"]" * 3000
_EVENT_EXTRA = (b'{"seq":1,"t":2,"kind":"op"}\n{"seq":2}\n', b'{"seq":1,"t":2,"kind":"print","values":7}\n',
                b'{"seq":1,"t":99999999999999999999999,"kind":"module_exit","error":true,"scope":"\\u001b[2J"}\n',
                _DEEP + b"\n")
_MANIFEST_EXTRA = (b'{"schema_version": 1, "reason": 3}', b'{"schema_version": 1, "created_ns": 1e308}',
                   b'{"schema_version": 1, "exception": {"where": 5}, "open_modules": [1, null]}', _DEEP)

TARGETS = [
    Target("rdr_ring_read", _ring_seeds, _read_ring),
    Target("rdr_ring_recover", _ring_seeds,
           _either(_recover, _recover_cli, os.path.join("api", "rank_1", "rdr", f"ring_{_PID}.obsring")),
           place=_place_ring),
    Target("rdr_manifest", _seeds_of("manifest.json", _MANIFEST_EXTRA),
           _both(_read_bundle, _bundle_cli("manifest.json")),
           place=_place_bundle("manifest.json")),
    Target("rdr_events", _seeds_of("events.jsonl", _EVENT_EXTRA), _both(_read_bundle, _bundle_cli("events.jsonl")),
           place=_place_bundle("events.jsonl")),
    Target("rdr_stacks", _seeds_of("stacks.json", (_DEEP,)), _both(_read_bundle, _bundle_cli("stacks.json")),
           place=_place_bundle("stacks.json")),
    Target("rdr_exception", _seeds_of("exception.json"), _both(_read_bundle, _bundle_cli("exception.json")),
           place=_place_bundle("exception.json")),
]

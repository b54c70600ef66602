"""A seeded mutation fuzzer for every reader of obs's files (print files, rings, manifests, bundles, configs).

A :class:`Target` names a reader, the intact files it starts from (seeds), where a mutated copy goes,
and the errors a reader may raise on damaged input (a clear ``DamagedFileError`` /
``NotOurFileError`` naming file and offset).  Anything else (a traceback, a hang, a memory
blow-up) is a finding.  Mutations: bit flips, byte edits, truncations, splices of two seeds,
insertions and deletions, varint and little-endian length edits.

``python -m tests.fuzz --cases 200000`` runs every target and prints the figures for the README;
``tests/test_fuzz.py`` runs a few thousand cases in CI.  Targets live in ``tests/fuzz/targets_*.py``
and are collected by :func:`all_targets`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import pkgutil
import random
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from obs._core.errors import DamagedFileError, NotOurFileError

__all__ = ["FuzzReport", "Rejected", "Target", "all_targets", "cli_exit", "mutate", "run_target"]

_HUGE = (0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 1 << 40, (1 << 64) - 1, 10**9, 0)


class Rejected(Exception):
    """A CLI target's clean rejection: the command printed an error and exited 1 or 2."""


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from obs.cli import build_parser

    return build_parser()


def cli_exit(*argv: str) -> int:
    """Run ``obs ARGV`` in this process with its output discarded; raise :class:`Rejected` on exit 1 or 2,
    AssertionError on any other non-zero code (an exception escaping ``main`` is a finding by itself).

    ``main`` parses with one parser built once: building it (argparse, gettext) costs more than most readers do
    with a case, and a parser parses any number of command lines alike."""
    import contextlib
    import io
    from unittest import mock

    import obs.cli

    parser = _parser()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            mock.patch.object(obs.cli, "build_parser", lambda: parser):
        code = obs.cli.main(list(argv))
    if code in (1, 2):
        raise Rejected(code)
    assert code == 0, f"obs {' '.join(argv)} exited {code}"
    return code


@dataclass(frozen=True)
class Target:
    """One reader under fuzz.

    ``seeds(scratch)`` makes the intact inputs (bytes) once, in a scratch folder; ``place(folder, data)``
    puts one mutated input where the reader looks and returns the path to read; ``read(path)`` runs the
    reader (its result is discarded).  ``allowed`` are the errors a reader may raise on bad input.
    """

    name: str
    seeds: Callable[[str], Sequence[bytes]]
    read: Callable[[str], object]
    place: Callable[[str, bytes], str] = field(default=lambda folder, data: _write(os.path.join(folder, "input"),
                                                                                   data))
    allowed: tuple[type[BaseException], ...] = (DamagedFileError, NotOurFileError, Rejected)


@dataclass
class FuzzReport:
    target: str
    cases: int = 0
    rejected: int = 0  #: cases that ended in an allowed, clear error
    findings: Counter[str] = field(default_factory=Counter)  #: "ErrorType: where" → count
    examples: dict[str, str] = field(default_factory=dict)  #: one traceback per finding
    seconds: float = 0.0

    @property
    def tracebacks(self) -> int:
        return sum(self.findings.values())


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as fh:
        fh.write(data)
    return path


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def mutate(data: bytes, rng: random.Random, seeds: Sequence[bytes]) -> bytes:
    """One to three random edits of ``data`` (another seed is the source of splices)."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        n = len(buf)
        op = rng.randrange(9)
        at = rng.randrange(n) if n else 0
        if op == 0 and n:  # bit flip
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # byte edit
            buf[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif op == 2:  # truncate
            del buf[rng.randrange(n + 1):]
        elif op == 3:  # splice another seed's tail
            other = rng.choice(seeds)
            cut = rng.randrange(len(other) + 1)
            buf[at:] = other[cut:cut + rng.randrange(1, 4096)]
        elif op == 4:  # insert
            buf[at:at] = rng.randbytes(rng.randrange(1, 16))
        elif op == 5 and n:  # delete a range
            del buf[at:at + rng.randrange(1, 64)]
        elif op == 6:  # varint edit: a huge length or tag value
            buf[at:at + rng.randrange(1, 3)] = _varint(rng.choice(_HUGE + (rng.randrange(1 << 35),)))
        elif op == 7 and n >= 4:  # a little-endian u32/u64 length field set to an edge value
            width = rng.choice((4, 8))
            at = min(at, max(0, n - width))
            value = rng.choice(_HUGE) & ((1 << (8 * width)) - 1)
            buf[at:at + width] = value.to_bytes(width, "little")
        elif op == 8 and n:  # duplicate a chunk (repeated records, repeated keys)
            chunk = buf[at:at + rng.randrange(1, 256)]
            buf[at:at] = chunk
    return bytes(buf)


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Timeout


def run_target(target: Target, cases: int, *, seed: int = 0, case_timeout_s: float = 5.0,
               keep_examples: bool = True) -> FuzzReport:
    """Run ``cases`` mutations of ``target``'s seeds through its reader."""
    rng = random.Random(f"{target.name}:{seed}")
    report = FuzzReport(target.name)
    scratch = tempfile.mkdtemp(prefix=f"obs-fuzz-{target.name}-")
    previous = signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    try:
        os.mkdir(os.path.join(scratch, "seeds"), 0o700)
        seeds = list(target.seeds(os.path.join(scratch, "seeds")))
        assert seeds, f"target {target.name} has no seeds"
        for case in range(cases):
            data = mutate(rng.choice(seeds), rng, seeds) if case >= len(seeds) else seeds[case]
            folder = os.path.join(scratch, "case")
            shutil.rmtree(folder, ignore_errors=True)
            os.mkdir(folder, 0o700)
            path = target.place(folder, data)
            signal.setitimer(signal.ITIMER_REAL, case_timeout_s)
            try:
                target.read(path)
            except target.allowed:
                report.rejected += 1
            except _Timeout:
                report.findings["hang"] += 1
            except (Exception, RecursionError) as exc:  # noqa: BLE001 - every other error is a finding
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                key = f"{type(exc).__name__} at {os.path.basename(frame.filename)}:{frame.lineno}"
                report.findings[key] += 1
                if keep_examples and key not in report.examples:
                    report.examples[key] = f"input {data[:200]!r}\n" + "".join(traceback.format_exception(exc))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            report.cases += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
        shutil.rmtree(scratch, ignore_errors=True)
        report.seconds = time.perf_counter() - started
    return report


def all_targets() -> list[Target]:
    """Every ``TARGETS`` list of the ``tests/fuzz/targets_*.py`` modules."""
    targets: list[Target] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("targets_"):
            targets.extend(importlib.import_module(f"{__name__}.{info.name}").TARGETS)
    return targets

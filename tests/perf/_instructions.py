"""Instructions per training step, counted by callgrind: the CPU work a variant adds, the same from run to run.

Timed ratios on this 2-core VM move by several percent between runs (memory reclaim, other tenants), more
than some budgets they must show.  An instruction count does not move with the machine.  It counts every
thread's instructions (the autograd engine's and gloo's too), but not cache misses, page faults or time spent
waiting: what slows a step through the memory system or the scheduler shows only in the timed tables, which
stay the benchmarks' measure.  The two are reported side by side.

A bench runs its child under ``valgrind --tool=callgrind --collect-atstart=no``; the child brackets each
variant's counted steps with :class:`Counter` (callgrind's client requests, through a tiny C helper compiled
here on first use), after untimed settling steps, so that imports and starts are not counted.  Numpy's
OpenBLAS threads are held to one: idle, they sleep natively, but spin under valgrind's serialised scheduler.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import NoReturn

__all__ = ["Counter", "available", "count_child", "count_steps", "per_step", "run_counted", "write_table"]

_HEADER = "/usr/include/valgrind/callgrind.h"
_SOURCE = """#include <valgrind/callgrind.h>
void obs_count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void obs_count_stop(const char *label) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(label); }
"""
_ENV = {"OPENBLAS_NUM_THREADS": "1", "OBS_COUNTING_INSTRUCTIONS": "1"}


def available() -> str | None:
    """None when instructions can be counted here, else why not."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (Debian: apt install valgrind)"
    if not os.path.exists(_HEADER):
        return f"{_HEADER} is missing (Debian: apt install valgrind)"
    if shutil.which("cc") is None:
        return "no C compiler (cc) for the callgrind helper"
    return None


class Counter:
    """In the child: ``with counter.counting(label)`` counts the instructions of its body (no-op outside valgrind)."""

    def __init__(self) -> None:
        self.active = os.environ.get("OBS_COUNTING_INSTRUCTIONS") == "1"
        self._lib = None
        if self.active:
            folder = tempfile.mkdtemp(prefix="obs-callgrind-helper-")
            src, lib = os.path.join(folder, "helper.c"), os.path.join(folder, "helper.so")
            with open(src, "w") as fh:
                fh.write(_SOURCE)
            subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
            self._lib = ctypes.CDLL(lib)
            shutil.rmtree(folder, ignore_errors=True)  # loaded: the file is no longer needed
            self._lib.obs_count_stop.argtypes = [ctypes.c_char_p]

    def start(self) -> None:
        if self._lib is not None:
            self._lib.obs_count_start()

    def stop(self, label: str) -> None:
        if self._lib is not None:
            self._lib.obs_count_stop(label.encode())


def count_steps(counter: Counter, step: Callable[[], None], variants: dict[str, Callable[[], Callable[[], None]]],
                settle: int, steps: int) -> None:
    """Each variant in turn: installed, ``settle`` uncounted steps (its start), ``steps`` counted ones, removed."""
    for name, setup in variants.items():
        teardown = setup()
        try:
            for _ in range(settle):
                step()
            counter.start()
            for _ in range(steps):
                step()
            counter.stop(name)
        finally:
            teardown()


def count_child(step: Callable[[], object], variants: dict[str, Callable[[], Callable[[], None]]], settle: int,
                steps: int, scratch: str | None = None) -> NoReturn:
    """A bench's child under callgrind: three warm-up steps, then :func:`count_steps` on one core's thread, then exit
    (the counts are written; the interpreter's exit under valgrind is slow), removing the folder ``scratch``."""
    import torch

    counter = Counter()
    torch.set_num_threads(1)
    for _ in range(3):
        step()
    count_steps(counter, step, variants, settle, steps)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    os._exit(0)


def per_step(script: str, args: list[str], steps: dict[str, int]) -> dict[str, dict[str, float]]:
    """Instructions per step of each workload's variants: ``script --count-child WORKLOAD *args`` for each workload
    of ``steps`` (workload -> steps it counts), all at once under callgrind."""
    why = available()
    if why is not None:
        raise SystemExit(f"--instructions: {why}")
    names = list(steps)
    counts = run_counted([[script, "--count-child", w, *args] for w in names])
    return {w: {v: n / steps[w] for v, n in c.items()} for w, c in zip(names, counts)}


def run_counted(children: list[list[str]], env: dict[str, str] | None = None) -> list[dict[str, int]]:
    """Run each ``python ARGV`` of ``children`` under callgrind, all at once; per child, the instructions of each
    counted block, by label."""
    folders = [tempfile.mkdtemp(prefix="obs-callgrind-") for _ in children]
    try:
        procs = []
        for folder, argv in zip(folders, children):
            # valgrind's messages to a file: a pipe read after another child's could fill and stall this one
            with open(os.path.join(folder, "stderr"), "w") as err:
                procs.append(subprocess.Popen(
                    ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--dump-instr=no",
                     f"--callgrind-out-file={folder}/cg.out", sys.executable, *argv],
                    stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **_ENV, **(env or {})}))
        results = []
        for proc, folder, argv in zip(procs, folders, children):
            if proc.wait() != 0:
                with open(os.path.join(folder, "stderr")) as fh:
                    raise RuntimeError(f"callgrind child {argv} failed ({proc.returncode}):\n{fh.read()[-3000:]}")
            results.append(_counts(folder))
        return results
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def _counts(folder: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in os.listdir(folder):
        if not name.startswith("cg.out"):
            continue
        with open(os.path.join(folder, name)) as fh:
            text = fh.read()
        label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
        if label and total:
            counts[label.group(1)] = int(total.group(1))
    return counts


def write_table(bench: str, table: dict[str, dict[str, float]], steps: dict[str, int], out: str) -> None:
    """Print the instructions per step of each variant on each workload and the ratio to plain; write them to JSON."""
    import torch

    names = list(table)
    print(f"{'variant':<34} " + " ".join(f"{w + ' instr/step':>15} {'ratio':>7}" for w in names) + "   (callgrind)")
    for v in table[names[0]]:
        print(f"{v:<34} " + " ".join(f"{table[w][v]:>15,.0f} {table[w][v] / table[w]['plain']:>7.4f}" for w in names))
    data = {"benchmark": f"{bench} --instructions", "torch": torch.__version__, "steps": steps,
            "instructions_per_step": {w: {v: round(n) for v, n in t.items()} for w, t in table.items()},
            "ratios": {w: {v: round(n / t["plain"], 4) for v, n in t.items()} for w, t in table.items()}}
    with open(out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {out}")

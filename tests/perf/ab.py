"""A/B of two trees on one benchmark: did a change make obs slower?

Run: python tests/perf/ab.py --base REV [--head REV] [--bench rdr|profiler|print|dump] [--variants "a|b"]
                             [--processes 6] [--rounds 12] [--instructions] [--out ab.json]

Each revision is checked out in a temporary git worktree and its native parts are built there (the C modules in
place, the C++ extensions into the user's cache, keyed by their sources); ``--head`` defaults to this working tree,
uncommitted changes included.  Both sides run *this* tree's benchmark harness (``tests/perf/bench_<bench>.py``),
with the side's code first on ``PYTHONPATH``: only obs differs between them.

Timed (default): ``--processes`` child processes per side, alternating base and head (base, head, head, base, ...
so that neither side always follows the other), each pinned to one core and timing every variant in rounds
alternating with plain PyTorch, as the benchmark does alone.  Per side it prints the median over processes of each
variant's ratio to plain (and of its paired ratio: the median of per-round ratios), and head/base: the median over
the process pairs of head's paired ratio over base's.  On this 2-core VM timed ratios move by a few percent from
run to run; the head/base column of one run is comparable, the absolute ratios only on a quiet machine.

``--instructions``: callgrind's instructions per step for each side (the benchmark's ``--instructions``), a
figure that does not move with the machine's load; head/base is their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PERF = Path(__file__).resolve().parent
ROOT = PERF.parents[1]
sys.path.insert(0, str(PERF))

from _harness import STEADY_MALLOC  # noqa: E402


@dataclass(frozen=True)
class Bench:
    """How ab.py drives one benchmark script: its timed child's arguments (``{scratch}``: a folder of this run;
    ``{url}``: an OTLP receiver's, started for the run) and whether it takes ``--variants`` (else every variant it
    has runs)."""

    script: str
    child: tuple[str, ...]
    variants: tuple[str, ...] = ()  # the A/B's default; empty: the bench has no --variants
    counts: bool = False  # it has --instructions

    @property
    def receiver(self) -> bool:
        return any("{url}" in a for a in self.child)


BENCHES = {"rdr": Bench("bench_rdr.py", ("--child", "--steps-only"),
                        ("plain", "rdr step", "rdr module", "rdr op, native", "torch.profiler"), counts=True),
           "profiler": Bench("bench_profiler.py", ("--child", "steps:{url}")),
           "print": Bench("bench_print_steps.py", ("--child",), counts=True),
           "dump": Bench("bench_dump.py", ("--child", "{scratch}"))}
WORKLOADS = ("mlp", "cnn")


@dataclass
class Side:
    name: str  # "base" or "head"
    rev: str  # what was asked for ("working tree" for this tree as it is)
    tree: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.tree)}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def checkout(name: str, rev: str | None, scratch: Path) -> Side:
    """The side's tree with its native parts built: a worktree at ``rev``, or this tree when ``rev`` is None."""
    if rev is None:
        side = Side(name, "working tree", ROOT)
    else:
        try:
            commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        except subprocess.CalledProcessError:
            raise SystemExit(f"ab: --{name} {rev!r} is not a revision of this repository") from None
        tree = scratch / name
        _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
        side = Side(name, f"{rev} ({commit[:10]})", tree)
    print(f"{name}: {side.rev}: building its native parts", file=sys.stderr)
    native = [sys.executable, "-m", "obs", "native", "build"]
    if "native" not in _run(side, [sys.executable, "-m", "obs", "--help"]):  # a tree from before `obs native`
        native = [sys.executable, "-c", "from recorder import native_ops; native_ops.build()"]
    _run(side, [sys.executable, "setup.py", "-q", "build_ext", "--inplace"])
    _run(side, native)
    return side


def _run(side: Side, command: list[str]) -> str:
    done = subprocess.run(command, cwd=side.tree, env=side.env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ab: {side.name} ({side.rev}): `{' '.join(command[1:])}` failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _child(side: Side, bench: str, args: list[str]) -> dict:
    script = BENCHES[bench].script
    done = subprocess.run([sys.executable, str(PERF / script), *args], cwd=side.tree, capture_output=True, text=True,
                          env={**side.env(), **STEADY_MALLOC})
    if done.returncode != 0:
        raise SystemExit(f"ab: {side.name} ({side.rev}): {script} {' '.join(args)} failed (this tree's "
                         f"harness on that side's obs):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _variant_args(bench: str, variants: list[str]) -> list[str]:
    return ["--variants", "|".join(variants)] if BENCHES[bench].variants else []


def timed(sides: tuple[Side, Side], bench: str, variants: list[str], processes: int, rounds: int,
          scratch: Path) -> dict:
    """Per side, workload and variant: the median ratio and paired ratio to plain; head/base per pair."""
    with _receiver(BENCHES[bench].receiver) as url:
        child = [a.format(scratch=scratch, url=url) for a in BENCHES[bench].child]
        args = [*child, "--rounds", str(rounds), *_variant_args(bench, variants)]
        runs: dict[str, list[dict]] = {s.name: [] for s in sides}
        for i in range(processes):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                runs[side.name].append(_child(side, bench, args))
                print(f"process {i + 1}/{processes}: {side.name} done", file=sys.stderr)
    table: dict[str, dict] = {}
    for w in WORKLOADS:
        names = list(runs["base"][0][w])
        row = {}
        for v in names:
            ratio = {s: [run[w][v] / run[w]["plain"] for run in runs[s]] for s in runs}
            paired = {s: [run[f"{w} paired"][v] for run in runs[s]] for s in runs}
            row[v] = {"base": statistics.median(ratio["base"]), "head": statistics.median(ratio["head"]),
                      "base paired": statistics.median(paired["base"]),
                      "head paired": statistics.median(paired["head"]),
                      "head/base": statistics.median(h / b for h, b in zip(paired["head"], paired["base"]))}
        table[w] = row
    return {"ratios": table, "per_process": runs}


@contextlib.contextmanager
def _receiver(wanted: bool) -> Iterator[str]:
    """An OTLP/HTTP receiver in a process of its own on the other cores (bench_profiler's), while the block runs;
    "" when the bench exports nothing."""
    if not wanted:
        yield ""
        return
    from bench_profiler import start_receiver

    proc, url = start_receiver()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(proc.pid, set(cores[:-1]))  # the children are pinned to the last core
    try:
        yield url
    finally:
        proc.communicate("", timeout=60)


def instructions(sides: tuple[Side, Side], bench: str, variants: list[str], scratch: Path) -> dict:
    """Per side, workload and variant: callgrind's instructions per step; head/base."""
    counts = {}
    for side in sides:
        out = scratch / f"{side.name}-instructions.json"
        done = subprocess.run([sys.executable, str(PERF / BENCHES[bench].script), "--instructions",
                               *_variant_args(bench, variants), "--out", str(out)], cwd=side.tree, env=side.env(),
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"ab: {side.name} ({side.rev}): {BENCHES[bench].script} --instructions failed:\n"
                             f"{done.stderr[-3000:]}")
        counts[side.name] = json.loads(out.read_text())["instructions_per_step"]
    return {w: {v: {"base": counts["base"][w][v], "head": counts["head"][w][v],
                    "head/base": counts["head"][w][v] / counts["base"][w][v]} for v in counts["base"][w]}
            for w in WORKLOADS}


def show(title: str, table: dict, columns: list[str], fmt: dict[str, str]) -> None:
    print(title)
    print(f"{'workload':<8} {'variant':<34} " + " ".join(f"{c:>13}" for c in columns))
    for w, rows in table.items():
        for v, row in rows.items():
            print(f"{w:<8} {v:<34} " + " ".join(f"{row[c]:>13{fmt.get(c, '.4f')}}" for c in columns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against (e.g. main, c55a737)")
    parser.add_argument("--head", help="the revision measured (default: this working tree, as it is)")
    parser.add_argument("--bench", choices=sorted(BENCHES), default="rdr")
    parser.add_argument("--variants", default="", metavar="NAME|...", help="the benchmark's variants (plain always)")
    parser.add_argument("--processes", type=int, default=6, help="timed processes per side (default 6)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--instructions", action="store_true", help="count instructions per step (callgrind)")
    parser.add_argument("--out", default="ab.json")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.rounds < 1:
        parser.error(f"--processes and --rounds must be at least 1 (got {args.processes}, {args.rounds})")
    bench = BENCHES[args.bench]
    if args.variants and not bench.variants:
        parser.error(f"--variants: {bench.script} runs all its variants; drop --variants")
    if args.instructions and not bench.counts:
        parser.error(f"--instructions: {bench.script} does not count instructions (rdr and print do)")
    chosen = args.variants.split("|") if args.variants else list(bench.variants)
    variants = ["plain"] + [v for v in chosen if v and v != "plain"]
    scratch = Path(tempfile.mkdtemp(prefix="obs-ab-"))
    try:
        sides = [checkout("base", args.base, scratch), checkout("head", args.head, scratch)]
        pair = (sides[0], sides[1])
        data: dict = {"benchmark": f"ab {args.bench}", "base": pair[0].rev, "head": pair[1].rev,
                      "variants": variants}
        if args.instructions:
            table = instructions(pair, args.bench, variants, scratch)
            data["instructions_per_step"] = table
            show("instructions per step (callgrind; every thread)", table, ["base", "head", "head/base"],
                 {"base": ",.0f", "head": ",.0f"})
        else:
            result = timed(pair, args.bench, variants, args.processes, args.rounds, scratch)
            data.update(result, processes=args.processes, rounds=args.rounds)
            show(f"ratio to plain PyTorch, median of {args.processes} processes per side (paired: of per-round "
                 "ratios); head/base: of paired ratios, per process pair", result["ratios"],
                 ["base", "head", "base paired", "head paired", "head/base"], {})
        with open(args.out, "w") as fh:
            json.dump(data, fh, indent=2)
        print(f"wrote {args.out}")
    finally:
        for name in ("base", "head"):
            if (scratch / name).exists():
                _git("worktree", "remove", "--force", str(scratch / name))
        shutil.rmtree(scratch, ignore_errors=True)
        _git("worktree", "prune")
    return 0


if __name__ == "__main__":
    sys.exit(main())

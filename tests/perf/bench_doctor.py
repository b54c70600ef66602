"""The job doctor at scale: ``obs top --once --json`` and ``obs rdr analyze --json`` on N simulated ranks.

Run: python tests/perf/bench_doctor.py [--ranks 64,128,256,512] [--repeats 3] [--limit-s 60] [--profile-ranks 512]
                                       [--profile-under 30] [--no-cold] [--dir DIR] [--out bench-doctor.json]
     (docs/benchmarks.md's table: --limit-s 1800 --profile-under inf; the default run takes about 10 minutes)

Budget (per command, at 512 ranks): <= 10 s and <= 1 GiB.  Per N, :mod:`sim_ranks` writes a job under a temporary
folder (removed at the end) with the real ring writer: full default rings (~13.9 MiB a rank), a 20-module model at
granularity ``module``, 8 bucket all_reduces a step, rank 7 slow by +50 ms in data loading.  Then:

* ``top``: ``python -m obs top --once --json ROOT`` while this process keeps every ring open and locked (the live
  path: a running job; its rings are in memory by nature, so there is no cold run of it);
* the job ends (the last step completes, every rank writes its ``normal_end`` bundle and marker as
  ``Recorder.dump`` does, the rings are removed as on a clean end);
* ``analyze``: ``python -m obs rdr analyze --json ROOT`` on the bundles, warm, then once with the job's files
  evicted from the page cache (``posix_fadvise(DONTNEED)`` on each of them, after ``sync``: the files of this
  job only, no root needed; ``fincore`` checks what is left resident where it is installed).

Each command runs in a fresh process, started by a small launcher process whose ``RUSAGE_CHILDREN`` peak RSS is the
command's own (a child forked from this process would start with this process's resident memory on its account).
Wall time is the median of ``--repeats`` runs, or one run where the first took longer than ``--repeat-under``
seconds; a run past ``--limit-s`` is killed, reported as such, and its command is not run on the larger jobs.
Every run's output is checked: the slow rank
must be the straggler (and, for ``top``, the rank the others wait for), and no other rank.

At ``--profile-ranks`` (default: the largest N), for a command whose run took at most ``--profile-under`` seconds,
the bench also runs ``recorder.live.read_job`` and
``recorder.analyze.analyze`` in this process: once with each stage timed (the module's functions wrapped with a
timer: no profiler overhead) and once under cProfile (top 15 functions by own time; cProfile slows Python-heavy
code 2-4x, so read its shares, not its seconds).  The growth with N is fitted (least squares of wall time, CPU time
and peak RSS against N, and against N and N^2) and extrapolated to 4,096 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from sim_ranks import SimConfig, SimJob, check_format  # type: ignore[import-not-found]  # beside this file

import recorder.analyze
import recorder.live

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET_S, BUDGET_MIB, BUDGET_RANKS = 10.0, 1024.0, 512
EXTRAPOLATE = (1024, 2048, 4096)
#: the stages timed in process: module → its functions that read_job / analyze call
STAGES = {
    "top": (recorder.live, ("find_rings", "_read_one", "line_up", "_mark")),
    "analyze": (recorder.analyze, ("list_bundles", "_markers", "_read_rank", "_mismatches", "line_up", "_stragglers",
                                   "_stuck", "_verdict")),
}
#: runs the command (argv[3:]) with a time limit (argv[1]) and its stdout to a file (argv[2]); prints its wall and CPU
#: seconds, peak RSS (KiB) and exit status
LAUNCHER = """
import json, resource, subprocess, sys, time
limit, out = float(sys.argv[1]), sys.argv[2]
with open(out, "wb") as fh:
    began = time.perf_counter()
    try:
        rc = subprocess.run(sys.argv[3:], stdout=fh, stderr=subprocess.PIPE, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.perf_counter() - began
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kib": usage.ru_maxrss, "rc": rc}))
"""


# -- running a command -------------------------------------------------------------------------------------------
def run_once(argv: list[str], limit_s: float, out: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(limit_s), out, *argv], capture_output=True, text=True,
                          check=True, cwd=REPO)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["peak_rss_mib"] = result.pop("maxrss_kib") / 1024
    return result


def measure(argv: list[str], *, repeats: int, repeat_under: float, limit_s: float, folder: str,
            check: Callable[[Any], list[str]]) -> dict[str, Any]:
    """Median wall time and peak RSS over the runs of ``argv``; ``check`` says what is wrong with its JSON output."""
    out = os.path.join(folder, "out.json")
    runs: list[dict[str, Any]] = []
    while len(runs) < repeats:
        run = run_once(argv, limit_s, out)
        runs.append(run)
        if run["rc"] is None or run["wall_s"] > repeat_under:
            break
    last = runs[-1]
    wrong: list[str] = []
    if last["rc"] is not None:
        try:
            with open(out, "rb") as fh:
                wrong = check(json.loads(fh.read()))
        except ValueError as exc:
            wrong = [f"output is not JSON: {exc}"]
    os.unlink(out)
    timed_out = last["rc"] is None
    return {"wall_s": last["wall_s"] if timed_out else statistics.median(r["wall_s"] for r in runs),
            "cpu_s": last["cpu_s"] if timed_out else statistics.median(r["cpu_s"] for r in runs),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs), "samples": [round(r["wall_s"], 3) for r in runs],
            "timed_out": timed_out, "rc": last["rc"], "correct": None if timed_out else not wrong, "wrong": wrong}


def check_top(slow: int) -> Callable[[Any], list[str]]:
    def check(doc: Any) -> list[str]:
        wrong = []
        stragglers = [r["rank"] for r in doc["ranks"] if r["straggler"]]
        if stragglers != [slow]:
            wrong.append(f"stragglers {stragglers}, expected [{slow}]")
        if doc["waited_for"] != [slow]:
            wrong.append(f"waited_for {doc['waited_for']}, expected [{slow}]")
        row = next((r for r in doc["ranks"] if r["rank"] == slow), None)
        if row is None or row["late_phase"] != "data":
            wrong.append(f"the slow rank's late phase is {row and row['late_phase']!r}, expected 'data'")
        if doc["gone"]:
            wrong.append(f"ranks read as gone: {doc['gone']}")
        return wrong
    return check


def check_analyze(slow: int, ranks: int) -> Callable[[Any], list[str]]:
    def check(doc: Any) -> list[str]:
        wrong = []
        late = [s["rank"] for s in doc["stragglers"] if s["lateness_s"] is not None]
        if late != [slow]:
            wrong.append(f"stragglers by arrival {late}, expected [{slow}]")
        if f"rank {slow} is a straggler" not in doc["verdict"] or doc["culprits"] not in ([], [slow]):
            wrong.append(f"verdict {doc['verdict']!r}, culprits {doc['culprits']}")
        phase = next((s["phase"] for s in doc["stragglers"] if s["rank"] == slow), None)
        if phase != "data":
            wrong.append(f"the slow rank's phase is {phase!r}, expected 'data'")
        if doc["world_size"] != ranks or doc["no_bundle"] or doc["mismatches"] or doc["problems"]:
            wrong.append(f"world {doc['world_size']}, no bundle {doc['no_bundle']}, mismatches "
                         f"{len(doc['mismatches'])}, problems {doc['problems'][:2]}")
        return wrong
    return check


# -- the page cache ----------------------------------------------------------------------------------------------
def files_under(root: str) -> Iterator[str]:
    for folder, _dirs, names in os.walk(root):
        for name in names:
            yield os.path.join(folder, name)


def evict(root: str) -> dict[str, Any]:
    """Drop the job's files from the page cache (they are written back first); what is left resident, per fincore."""
    os.sync()
    count = 0
    for path in files_under(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return {"files": count, "resident_mib": resident_mib(root)}


def resident_mib(root: str) -> float | None:
    """MiB of the job's files in the page cache (``fincore``), None without it."""
    if shutil.which("fincore") is None:
        return None
    total = 0
    paths = list(files_under(root))
    for at in range(0, len(paths), 500):
        done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *paths[at:at + 500]],
                              capture_output=True, text=True)
        total += sum(int(line) for line in done.stdout.split() if line.isdigit())
    return total / 2**20


# -- in process: stages and profile ------------------------------------------------------------------------------
@contextlib.contextmanager
def timed_stages(name: str) -> Iterator[dict[str, float]]:
    """Wrap the stage functions of ``STAGES[name]`` with a timer (seconds summed over their calls)."""
    module, names = STAGES[name]
    spent: dict[str, float] = {}
    saved = {}
    for fn in names:
        original = getattr(module, fn, None)
        if original is None:  # renamed since: timed as part of the rest
            continue
        saved[fn] = original

        def wrapper(*args: Any, _fn: str = fn, _original: Any = original, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_fn] = spent.get(_fn, 0.0) + time.perf_counter() - began
        setattr(module, fn, wrapper)
    try:
        yield spent
    finally:
        for fn, original in saved.items():
            setattr(module, fn, original)


def in_process(name: str, call: Callable[[], Any], top: int = 15) -> dict[str, Any]:
    """``call`` once with its stages timed, once under cProfile (top functions by own time)."""
    with timed_stages(name) as spent:
        began = time.perf_counter()
        call()
        total = time.perf_counter() - began
    stages = {fn: round(s, 3) for fn, s in sorted(spent.items(), key=lambda kv: -kv[1])}
    stages["(rest)"] = round(total - sum(spent.values()), 3)
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    call()
    profile.disable()
    profiled = time.perf_counter() - began
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_cc, calls, own, cum, _callers) in sorted(stats.stats.items(),  # type: ignore[attr-defined]
                                                                      key=lambda kv: -kv[1][2])[:top]:
        where = os.path.relpath(file, REPO) if file.startswith(REPO) else os.path.basename(file)
        rows.append({"function": f"{where}:{line}({fn})", "calls": calls, "own_s": round(own, 3),
                     "cumulative_s": round(cum, 3), "own_share": round(own / profiled, 3)})
    return {"seconds": round(total, 3), "stages_s": stages, "profiled_seconds": round(profiled, 3), "top": rows}


# -- growth -------------------------------------------------------------------------------------------------------
def fit(ns: list[int], ys: list[float]) -> dict[str, Any]:
    """Least squares of y against (1, N) and, with 4 points or more, (1, N, N^2), each with its values at EXTRAPOLATE;
    the log-log slope of the last two points (1: linear, 2: quadratic).  Four noisy points cannot tell a small N^2
    term from noise: read the linear line as the estimate and the quadratic as its upper side."""
    x = np.array(ns, float)
    y = np.array(ys, float)
    out: dict[str, Any] = {}
    if len(ns) < 2:
        return out
    out["slope_loglog_last_two"] = round(float(np.log(y[-1] / y[-2]) / np.log(x[-1] / x[-2])), 3)
    for name, degree in (("linear", 1), ("quadratic", 2)):
        if len(ns) < 2 * degree:
            continue
        coef = np.polyfit(x, y, degree)
        out[name] = {"coefficients_high_first": [float(c) for c in coef],
                     "max_residual": round(float(np.max(np.abs(np.polyval(coef, x) - y))), 3),
                     "at": {str(n): round(float(np.polyval(coef, n)), 1) for n in EXTRAPOLATE}}
    return out


# -- one job ------------------------------------------------------------------------------------------------------
def bench_ranks(ranks: int, folder: str, args: argparse.Namespace, skip: dict[str, str]) -> dict[str, Any]:
    """Both commands on a job of ``ranks``; ``skip``: command → why it is not run (it timed out on a smaller job)."""
    root = os.path.join(folder, f"job_{ranks}")
    scratch = os.path.join(folder, "scratch")
    os.makedirs(scratch, exist_ok=True)
    config = SimConfig(ranks=ranks)
    job = SimJob(root, config)
    out: dict[str, Any] = {"ranks": ranks, "steps": job.timeline.steps, "slow_rank": config.slow,
                           "load_average_before": os.getloadavg()}
    python = sys.executable
    options = {"repeats": args.repeats, "repeat_under": args.repeat_under, "limit_s": args.limit_s,
               "folder": scratch}
    top = [python, "-m", "obs", "top", "--once", "--json", root]
    analyze = [python, "-m", "obs", "rdr", "analyze", "--json", root]
    try:
        began = time.perf_counter()
        job.start()
        out["write_rings_s"] = round(time.perf_counter() - began, 1)
        out["ring_mib"] = round(sum(os.path.getsize(p) for p in files_under(root)) / 2**20, 1)
        if "top" in skip:
            out["top"] = {"skipped": skip["top"]}
        else:
            out["top"] = measure(top, check=check_top(config.slow), **options)
            say(ranks, "top (live rings)", out["top"])
            if ranks == args.profile_ranks:
                out["profile_top"] = maybe_profile("top", out["top"], args, lambda: recorder.live.read_job(root))
        if "analyze" in skip:
            out["analyze"] = {"skipped": skip["analyze"]}
            return out
        began = time.perf_counter()
        job.finish()
        job.dump()
        out["write_bundles_s"] = round(time.perf_counter() - began, 1)
    finally:
        job.close(remove=True)
        if "analyze" in skip:
            shutil.rmtree(root)
    try:
        out["bundle_mib"] = round(sum(os.path.getsize(p) for p in files_under(root)) / 2**20, 1)
        out["analyze"] = measure(analyze, check=check_analyze(config.slow, ranks), **options)
        say(ranks, "analyze", out["analyze"])
        if args.cold and not out["analyze"]["timed_out"]:
            evicted = evict(root)
            out["analyze_cold_cache"] = measure(analyze, check=check_analyze(config.slow, ranks),
                                                **{**options, "repeats": 1})
            out["analyze_cold_cache"]["evicted"] = evicted
            say(ranks, "analyze (cold cache)", out["analyze_cold_cache"])
            out["read_every_byte_cold_s"] = read_cold(root)
        if ranks == args.profile_ranks:
            out["profile_analyze"] = maybe_profile("analyze", out["analyze"], args,
                                                   lambda: recorder.analyze.analyze(root))
    finally:
        shutil.rmtree(root)
    out["load_average_after"] = os.getloadavg()
    return out


def maybe_profile(name: str, measured: dict[str, Any], args: argparse.Namespace,
                  call: Callable[[], Any]) -> dict[str, Any]:
    """The in-process stages and profile of a command whose run took at most ``--profile-under`` seconds."""
    if measured["timed_out"] or measured["wall_s"] > args.profile_under:
        why = (f"not profiled: its run took {measured['wall_s']:.0f} s (> --profile-under {args.profile_under:g}; the "
               "in-process stages and cProfile take about 4x that)")
        print(f"  {name}: {why}")
        return {"skipped": why}
    result = in_process(name, call)
    print(f"  {name} in process: {result['seconds']} s; stages {result['stages_s']}", flush=True)
    return result


def read_cold(root: str) -> float:
    """Seconds to read every byte of the job's files once from a cold page cache: the I/O floor of a reader that
    reads them all."""
    evict(root)
    began = time.perf_counter()
    for path in files_under(root):
        with open(path, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass
    return round(time.perf_counter() - began, 2)


def say(ranks: int, what: str, m: dict[str, Any]) -> None:
    verdict = "KILLED at the limit" if m["timed_out"] else "correct" if m["correct"] else \
        "WRONG: " + "; ".join(m["wrong"])
    print(f"{ranks:>6} ranks  {what:<22} {m['wall_s']:8.2f} s (CPU {m['cpu_s']:.2f} s)  {m['peak_rss_mib']:8.1f} MiB  "
          f"runs {m['samples']}  {verdict}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="64,128,256,512", help="comma-separated job sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repeat-under", type=float, default=30.0,
                        help="repeat a command only while its run took less than this (s)")
    parser.add_argument("--limit-s", type=float, default=60.0,
                        help="kill a run after this (s); a command killed is not run on the larger jobs")
    parser.add_argument("--profile-ranks", type=int, default=None, help="profile at this N (default: the largest)")
    parser.add_argument("--profile-under", type=float, default=30.0,
                        help="profile a command only where its run took at most this (s; inf: always)")
    parser.add_argument("--no-cold", dest="cold", action="store_false", help="skip the cold-cache run of analyze")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes (default: the system's)")
    parser.add_argument("--out", default="bench-doctor.json")
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.ranks.split(","))
    if args.profile_ranks is None:
        args.profile_ranks = sizes[-1]
    folder = tempfile.mkdtemp(prefix="obs-bench-doctor-", dir=args.dir)
    args.tree_at_start = tree()  # the readers are imported afresh by every command: say if they changed meanwhile
    results: list[dict[str, Any]] = []
    skip: dict[str, str] = {}
    try:
        check_format(folder)  # the simulator's slots are the ring writer's
        for ranks in sizes:
            results.append(bench_ranks(ranks, folder, args, skip))
            for command in ("top", "analyze"):
                if results[-1][command].get("timed_out"):
                    skip.setdefault(command, f"killed after {args.limit_s:g} s at {ranks} ranks")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    data = summarize(results, args)
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")
    wrong = [r[c] for r in results for c in ("top", "analyze") if r[c].get("correct") is False]
    return 1 if wrong else 0


def tree() -> dict[str, Any]:
    """The commit measured, and the files of the readers that differ from it."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "--", "recorder", "obs").splitlines()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    growth = {}
    for command in ("top", "analyze"):
        done = [r for r in results if "wall_s" in r[command] and not r[command]["timed_out"]]
        growth[command] = {key: fit([r["ranks"] for r in done], [r[command][key] for r in done])
                           for key in ("wall_s", "cpu_s", "peak_rss_mib")}
    at = next((r for r in results if r["ranks"] == BUDGET_RANKS), None)
    budgets = None
    if at is not None:
        budgets = {c: {"wall_s": at[c].get("wall_s"), "peak_rss_mib": at[c].get("peak_rss_mib"),
                       "timed_out": at[c].get("timed_out"), "skipped": at[c].get("skipped"),
                       "met": "wall_s" in at[c] and not at[c]["timed_out"] and at[c]["wall_s"] <= BUDGET_S
                       and at[c]["peak_rss_mib"] <= BUDGET_MIB} for c in ("top", "analyze")}

    def cell(m: dict[str, Any] | None, key: str) -> str:
        if not m or key not in m:
            return "-" if not m or "skipped" not in m else "skipped"
        return f"{'>' if m.get('timed_out') else ''}{m[key]:.1f}"

    head = ("ranks", "top s", "top CPU s", "top MiB", "analyze s", "analyze CPU s", "analyze MiB", "cold s")
    print("\n" + " ".join(f"{h:>13}" for h in head))
    for r in results:
        cells = [str(r["ranks"]), cell(r["top"], "wall_s"), cell(r["top"], "cpu_s"), cell(r["top"], "peak_rss_mib"),
                 cell(r["analyze"], "wall_s"), cell(r["analyze"], "cpu_s"), cell(r["analyze"], "peak_rss_mib"),
                 cell(r.get("analyze_cold_cache"), "wall_s")]
        print(" ".join(f"{c:>13}" for c in cells))
    for command in ("top", "analyze"):
        for key in ("cpu_s", "wall_s", "peak_rss_mib"):
            g = growth[command][key]
            fits = ", ".join(f"{name} {g[name]['at']}" for name in ("linear", "quadratic") if name in g)
            print(f"{command} {key}: log-log slope {g.get('slope_loglog_last_two')}; {fits or 'too few sizes'}")
    if budgets:
        print(f"budgets at {BUDGET_RANKS} ranks (<= {BUDGET_S:g} s, <= {BUDGET_MIB:g} MiB): "
              + "; ".join(f"{c} {'met' if b['met'] else 'missed'}" for c, b in budgets.items()))
    return {"benchmark": "doctor", "tree": {"at_start": args.tree_at_start, "at_end": tree()},
            "python": platform.python_version(), "cpu": cpu_name(),
            "cores": len(os.sched_getaffinity(0)), "ranks": [r["ranks"] for r in results],
            "options": {k: str(v) if v == float("inf") else v for k, v in vars(args).items()
                        if k not in ("out", "dir", "tree_at_start")},
            "budget": {"ranks": BUDGET_RANKS, "wall_s": BUDGET_S, "peak_rss_mib": BUDGET_MIB}, "budgets": budgets,
            "results": results, "growth": growth}


if __name__ == "__main__":
    sys.exit(main())

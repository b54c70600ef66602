"""The ``obs`` command line: argument parsing and dispatch; each view renders in its own module.

Exit codes: 0 success, 1 the thing checked or run failed, 2 bad command line or bad input.
``obs run`` returns the script's own exit status.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from obs.cli._exit import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "main"]


def _parse_set(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` where VALUE is JSON when it parses as JSON, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE (got {text!r})")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _settings_arguments(parser: argparse.ArgumentParser) -> None:
    from obs.settings.env_config_file import SECTIONS

    parser.add_argument("--config", metavar="FILE", help=f"env config JSON (sections {', '.join(SECTIONS)}), i.e. "
                        "set_context(env_config_path=FILE); default: $OBS_CONFIG")
    parser.add_argument("--set", dest="sets", metavar="KEY=VALUE", action="append", type=_parse_set, default=[],
                        help="a set_context key (repeatable); VALUE is read as JSON when it is JSON, e.g. "
                             "--set save_graphs=1 --set print_file_path=print.pb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="obs", description="Observability and debugging runtime for PyTorch "
                                     "training.")
    from obs._core.version import __version__

    parser.add_argument("--version", action="version", version=f"obs {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show Python tracebacks of obs's own errors "
                        "(accepted anywhere on the line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("options", help="list every option: name, type, default, devices, meaning")
    p.add_argument("--table", choices=("context", "auto_parallel", "ps", "env_config", "dump_config", "all"),
                   default="all", help="one table (dump_config: MINDSPORE_DUMP_CONFIG's fields)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("config", help="work with env config files")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    c = csub.add_parser("check", help="validate a file and show what it turns on")
    c.add_argument("file")
    c.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("print", help="show the values of a print file (print_file_path), like parse_print")
    p.add_argument("file")
    p.add_argument("--follow", "-f", action="store_true", help="keep reading as a running job appends calls")
    p.add_argument("--partial", action="store_true", help="skip damaged records (and a truncated last one), "
                   "show the intact calls, and say what was skipped")
    p.add_argument("--json", action="store_true", help="one JSON object per call (JSON lines)")

    p = sub.add_parser("rdr", help="post-mortem: Running Data Recorder bundles",
                       description="Post-mortem views of RDR bundles. --json: one JSON document for a single "
                       "object (ls, show, recover, analyze, snapshot), JSON lines (one record per line) for streams "
                       "(events). "
                       "Exit 1 when a bundle or ring is damaged (the others are still shown), 2 on bad input.")
    rsub = p.add_subparsers(dest="rdr_command", metavar="ACTION")
    rsub.required = True
    r = rsub.add_parser("ls", help="bundles under PATH, newest first (default $MS_RDR_PATH or .)")
    r.add_argument("path", nargs="?", help="an RDR root, a rank or rdr folder (default $MS_RDR_PATH or .)")
    r.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    r = rsub.add_parser("show", help="what happened: reason, step, failing module/op, exception, timeline, stacks")
    r.add_argument("bundle", help="a bundle folder, an rdr folder (its newest bundle) or .../latest")
    r.add_argument("--last", type=int, default=30, help="events in the timeline (default 30)")
    r.add_argument("--all-threads", action="store_true", help="also show the stacks of obs's own threads "
                   "(obs-*, the watchdog), collapsed by default")
    r.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    r = rsub.add_parser("events", help="the recorded events of a bundle")
    r.add_argument("bundle")
    r.add_argument("--kind", action="append", default=[], help="only these kinds (repeatable or comma-separated): "
                   "step_begin, step_end, module_enter, module_exit, op, memory, collective, print, fault, "
                   "settings, graph, marker")
    r.add_argument("--step", type=int, default=None, help="only the events of training step N (every event has "
                   "one, at every granularity)")
    r.add_argument("--last", type=int, default=None, help="only the last N")
    r.add_argument("--json", action="store_true", help="machine-readable output (JSON lines: one event per line)")
    r = rsub.add_parser("recover", help="turn the rings of dead processes (SIGKILL, OOM, segfault) into bundles")
    r.add_argument("path", nargs="?", help="an rdr folder, a tree of them, or one ring file (default $MS_RDR_PATH "
                   "or .)")
    r.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    r = rsub.add_parser("analyze", help="line up the ranks of a job (their newest bundles) and name the culprit: "
                        "the first collective they disagree on, ranks that raised or left no bundle, stragglers; "
                        "exit 1 when one is found, 0 when consistent")
    r.add_argument("path", nargs="?", help="the job's RDR root (the folder of rank_* folders; default $MS_RDR_PATH "
                   "or .)")
    r.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    r = rsub.add_parser("snapshot", help="a running job: every live rank writes a bundle now (every thread's stack, "
                        "what it is doing) and goes on; exit 1 when a live rank did not answer")
    r.add_argument("path", nargs="?", help="the job's RDR root (the folder of rank_* folders; default $MS_RDR_PATH "
                   "or .)")
    r.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the ranks' answers "
                   "(default 10)")
    r.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")

    p = sub.add_parser("top", help="a live table of every rank of a running job (from its rings, or from "
                                   "Prometheus with --prometheus): step, steps/s, phases, the rank the others wait for")
    p.add_argument("path", nargs="?", help="an RDR root, a rank or rdr folder (default $MS_RDR_PATH or .)")
    p.add_argument("--prometheus", metavar="URL", help="read the job from this Prometheus server (a job across "
                   "nodes, its ranks found through file service discovery) instead of its rings")
    p.add_argument("--run", metavar="RUN_ID", help="with --prometheus: the run to show (default: the newest)")
    p.add_argument("--window", default="1m", metavar="DURATION", help="with --prometheus: the PromQL range that "
                   "rates and means are taken over (default 1m)")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument("--json", action="store_true", help="print one JSON document and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p = sub.add_parser("metrics", help="the profiler's metrics in Prometheus: its alerting rules")
    msub = p.add_subparsers(dest="metrics_command", metavar="ACTION")
    msub.required = True
    msub.add_parser("rules", help="print the Prometheus alerting rules (hung rank, straggler, throughput down, "
                    "exporter down, NaN/Inf, memory climbing) to save and load with rule_files")
    p = sub.add_parser("trace", help="profiler traces: summary of a trace file or folder, re-export to a collector",
                       description="Views of the profiler's output (trace.json, traces.otlp.jsonl, or the output "
                       "folder, default ./obs_profile). Exit 1 when spans were dropped or a file is damaged, 2 on "
                       "bad input.")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    tsub.required = True
    t = tsub.add_parser("summary", help="step time p50/p90/p99/max, phase breakdown, top modules and ops, span and "
                        "drop counts")
    t.add_argument("path", nargs="?", default="obs_profile", help="a trace.json, a traces.otlp.jsonl or an output "
                   "folder (default ./obs_profile)")
    t.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    t = tsub.add_parser("export", help="re-send saved OTLP JSON lines to a collector (air-gapped clusters)")
    t.add_argument("path", help="a traces.otlp.jsonl or an output folder")
    t.add_argument("--endpoint", required=True, help="the collector, e.g. http://localhost:4318 (HTTP) or "
                   "http://localhost:4317 (gRPC)")
    t.add_argument("--protocol", choices=("http/protobuf", "grpc"), default="http/protobuf")
    t.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    t = tsub.add_parser("capture", help="a running job: every live rank records module (and op) spans for its next "
                        "N steps, then goes back to step and phase spans; exit 1 when a live rank did not answer")
    t.add_argument("path", nargs="?", default="obs_profile", help="the profiler's output folder (profiler.output, "
                   "default ./obs_profile) or one rank's folder")
    t.add_argument("--steps", type=int, required=True, metavar="N", help="how many steps to capture")
    t.add_argument("--level", choices=("task_trace", "op_trace"), default="task_trace",
                   help="task_trace: module spans (default); op_trace: module and op spans")
    t.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the ranks' answers "
                   "(default 10)")
    t.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")

    p = sub.add_parser("graph", help="graph/IR dumps (save_graphs): list, summarize, diff, render",
                       description="Views of the .ir files save_graphs writes. --json: one JSON document. Exit 1 "
                       "when a file is damaged, when diff finds differences, or when render has no Graphviz; 2 on "
                       "bad input.")
    gsub = p.add_subparsers(dest="graph_command", metavar="ACTION")
    gsub.required = True
    g = gsub.add_parser("ls", help="the graphs of a save_graphs folder (and its rank_* folders)")
    g.add_argument("path", nargs="?", help="the folder (default $MS_DEV_SAVE_GRAPHS_PATH or .)")
    g.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    g = gsub.add_parser("show", help="one graph: nodes by op, params and sizes, largest tensors, scope tree")
    g.add_argument("file", help="an .ir file")
    g.add_argument("--top", type=int, default=10, help="largest tensors shown (default 10)")
    g.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    g = gsub.add_parser("diff", help="what changed between two graphs (recompilation debugging); exit 1 if any")
    g.add_argument("a", help="the first .ir file")
    g.add_argument("b", help="the second .ir file")
    g.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    g = gsub.add_parser("render", help="render a .dot (or an .ir) to SVG/PNG with Graphviz's dot")
    g.add_argument("file", help="a .dot or .ir file")
    g.add_argument("-o", "--output", help="the image to write (default: FILE with the format's extension)")
    g.add_argument("--format", choices=("svg", "png", "pdf"), default="svg")

    p = sub.add_parser("dump", help="data dumps (MindSpore layout) and exception/NaN fault folders: list, statistics, "
                       "diff two runs", description="Views of a data dump folder (the dump config's path, a rank "
                       "folder or an iteration folder). --json: one JSON document (ls, diff), JSON lines (stats). "
                       "Exit 1 when diff finds a divergence or a file is damaged, 2 on bad input.")
    dsub = p.add_subparsers(dest="dump_command", metavar="ACTION")
    dsub.required = True
    d = dsub.add_parser("ls", help="iterations (tensors, size, statistic.csv) and exception/NaN fault folders")
    d.add_argument("path", help="the dump folder")
    d.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    d = dsub.add_parser("stats", help="rows of statistic.csv: per op, input/output slot, the chosen statistics")
    d.add_argument("path", help="the dump folder")
    d.add_argument("--op", metavar="REGEX", help="only ops whose name or type matches")
    d.add_argument("--iteration", type=int, help="only this iteration")
    d.add_argument("--io", choices=("input", "output"), help="only inputs or outputs")
    d.add_argument("--limit", type=int, help="at most N rows")
    d.add_argument("--json", action="store_true", help="machine-readable output (JSON lines: one row per line)")
    d = dsub.add_parser("diff", help="two runs op by op, aligned: the op that produced a difference (its inputs "
                        "agree, its outputs do not), the ops that carried it on, the ops inserted or removed; exit 1 "
                        "if an op diverges")
    d.add_argument("a", help="the first dump folder")
    d.add_argument("b", help="the second dump folder (the reference)")
    d.add_argument("--rtol", type=float, help="relative tolerance (default 1e-5, or the preset's)")
    d.add_argument("--atol", type=float, help="absolute tolerance (default 1e-8, or the preset's)")
    d.add_argument("--tolerance", choices=("auto", "fp64", "fp32", "tf32", "fp16", "bf16"),
                   help="tolerances of a dtype for every tensor (bf16: a bf16 run against an fp32 one), or auto: each "
                   "pair by its coarser dtype; --rtol/--atol replace the preset's")
    d.add_argument("--iteration", type=int, help="only this iteration")
    d.add_argument("--top", type=int, default=10, metavar="N", help="divergent ops listed (default 10)")
    d.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report: a row per aligned op, "
                   "a plot of the error against the op index")
    d.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")

    p = sub.add_parser("monitor", help="the training-health monitor's runs: the series that moved most, the "
                       "anomalies in causal order", description="Views of a monitor run folder (msprobe's CSV "
                       "layout; PATH may be the folder of runs: the job that ran last is read, its ranks merged). "
                       "--json: one JSON document. explain exits 1 when it finds an anomaly; 1 on a damaged file, "
                       "2 on bad input.")
    msub = p.add_subparsers(dest="monitor_command", metavar="ACTION")
    msub.required = True
    m = msub.add_parser("show", help="a per-step table of the series that moved most")
    m.add_argument("path", help="a run folder ({time}-rank{r}-{id}) or the folder of runs (monitor.path)")
    m.add_argument("--top", type=int, default=6, metavar="K", help="series shown (default 6)")
    m.add_argument("--step", type=int, default=None, metavar="N", help="center the table on step N (default: the "
                   "top series' peak)")
    m.add_argument("--rows", type=int, default=12, metavar="R", help="steps shown (default 12)")
    m.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    m = msub.add_parser("explain", help="the anomalies in causal order: step, then forward in module order, "
                        "backward in reverse, then the optimizer; the first names the series that left its history "
                        "first; exit 1 when there is one")
    m.add_argument("path", help="a run folder ({time}-rank{r}-{id}) or the folder of runs (monitor.path)")
    m.add_argument("--step", type=int, default=None, metavar="N", help="only the window of steps N-SPAN..N+SPAN")
    m.add_argument("--span", type=int, default=20, help="the window's half width with --step (default 20)")
    m.add_argument("--limit", type=int, default=30, help="anomalies listed (default 30; --json lists all)")
    m.add_argument("--json", action="store_true", help="machine-readable output (one JSON document: first, "
                   "anomalies, loss_step, lead_steps)")
    m = msub.add_parser("plot", help="one self-contained HTML page: a layer x step heatmap per series kind, the loss "
                        "and gradient-norm curves, the anomalies marked, the first one at the top")
    m.add_argument("path", help="a run folder ({time}-rank{r}-{id}) or the folder of runs (monitor.path)")
    m.add_argument("--html", required=True, metavar="OUT", help="the page to write")
    m.add_argument("--columns", type=int, default=400, metavar="C", help="step columns at most (default 400; a "
                   "longer run is binned, each column the largest value of its steps)")

    p = sub.add_parser("native", help="obs's native extensions: which are in use, and why not; build them ahead "
                       "of time", description="Every native part has a Python path that does the same work. "
                       "OBS_NATIVE=0 asks for the Python path of every part, OBS_NATIVE_<PART>=0 for one. "
                       "Exit 1 when a part could not be built or loaded.")
    nsub = p.add_subparsers(dest="native_command", metavar="ACTION")
    nsub.required = True
    n = nsub.add_parser("status", help="each extension: its part, whether it is in use, and why not")
    n.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    n = nsub.add_parser("build", help="build the C++ extensions for the installed torch now (CI, images), "
                        "instead of at first use")
    n.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")

    p = sub.add_parser("run", help="run a Python script with obs settings applied (like python -m cProfile)")
    p.set_defaults(usage_error=p.error)
    _settings_arguments(p)
    p.add_argument("script", nargs="?", help="the training script (obs options go before it)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script (optional)")

    p = sub.add_parser("demo", help="train a small model on synthetic data with the configured features")
    _settings_arguments(p)
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--fail-at", type=int, metavar="STEP", help="raise in the model's forward at this step (to see "
                   "what the Running Data Recorder keeps)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _exit_code(exc: BaseException) -> int:
    """docs/cli.md: a damaged file of ours is 1 (a check found a problem); every other input error is 2."""
    from obs._core.errors import DamagedFileError

    return EXIT_FAILURE if isinstance(exc, DamagedFileError) else EXIT_USAGE


def _quiet_closed_pipe() -> int:
    """``obs ... | head``: the reader left; stop writing without a word, as Unix tools do."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    # --traceback is accepted anywhere before the script of `obs run` (whose own arguments are its own).
    cut = next((i for i, a in enumerate(argv) if a in ("run",)), len(argv))
    script_at = next((i for i in range(cut + 1, len(argv)) if not argv[i].startswith("-")), len(argv))
    show_traceback = "--traceback" in argv[:script_at]
    argv = [a for i, a in enumerate(argv) if not (a == "--traceback" and i < script_at)]
    parser = build_parser()
    if not argv:
        parser.print_help()
        return EXIT_OK
    args = parser.parse_args(argv)
    args.traceback = show_traceback
    try:
        return _dispatch(args)
    except BrokenPipeError:
        return _quiet_closed_pipe()
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, OSError) as exc:
        if args.traceback:
            raise
        from obs.cli._render import error

        error(_message(exc))
        return _exit_code(exc)


def _message(exc: BaseException) -> str:
    """``str(exc)`` without the ``[Errno N]`` prefix of OSErrors, with the file name where one is known."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, (ValueError, TypeError)):
        if exc.filename is not None and str(exc.filename) not in exc.strerror:
            return f"{exc.filename}: {exc.strerror}"
        return exc.strerror
    return str(exc)


def _usage(message: str) -> int:
    from obs.cli._render import error

    error(message)
    return EXIT_USAGE


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "options":
        from obs.cli._options_view import run_options

        return run_options(args.table, as_json=args.json)
    if args.command == "config":
        from obs.cli._config_view import run_check

        return run_check(args.file, as_json=args.json)
    if args.command == "print":
        from obs.cli._print_view import run_print

        return run_print(args.file, follow=args.follow, as_json=args.json, partial=args.partial)
    if args.command == "dump":
        from obs.cli import _dump_view as dump_view

        if args.dump_command == "ls":
            return dump_view.run_ls(args.path, as_json=args.json)
        if args.dump_command == "stats":
            return dump_view.run_stats(args.path, op=args.op, iteration=args.iteration, io=args.io,
                                       as_json=args.json, limit=args.limit)
        return dump_view.run_diff(args.a, args.b, rtol=args.rtol, atol=args.atol, tolerance=args.tolerance,
                                  iteration=args.iteration, top=args.top, html=args.html, as_json=args.json)
    if args.command == "rdr":
        from obs.cli import _rdr_view as view

        if args.rdr_command == "ls":
            return view.run_ls(args.path, as_json=args.json)
        if args.rdr_command == "show":
            return view.run_show(args.bundle, last=args.last, as_json=args.json, all_threads=args.all_threads)
        if args.rdr_command == "events":
            return view.run_events(args.bundle, kinds=args.kind, last=args.last, as_json=args.json, step=args.step)
        if args.rdr_command == "analyze":
            from obs.cli._rdr_analyze_view import run_analyze

            return run_analyze(args.path, as_json=args.json)
        if args.rdr_command == "snapshot":
            from obs.cli._rdr_snapshot_view import run_snapshot

            return run_snapshot(args.path, timeout=args.timeout, as_json=args.json)
        return view.run_recover(args.path, as_json=args.json)
    if args.command == "top":
        if args.prometheus is not None:
            if args.path is not None:
                return _usage(f"obs top: give a PATH (the rings) or --prometheus URL, not both (got {args.path!r} "
                              f"and {args.prometheus!r})")
            from obs.cli._top_prometheus_view import run_top_prometheus

            return run_top_prometheus(args.prometheus, args.run, once=args.once, as_json=args.json,
                                      interval=args.interval, window=args.window)
        if args.run is not None:
            return _usage(f"obs top: --run {args.run!r} needs --prometheus URL (the rings show the newest run "
                          f"under PATH)")
        from obs.cli._top_view import run_top

        return run_top(args.path, once=args.once, as_json=args.json, interval=args.interval)
    if args.command == "metrics":
        from obs.cli._metrics_view import run_rules

        return run_rules()
    if args.command == "trace":
        from obs.cli import _trace_view

        if args.trace_command == "summary":
            return _trace_view.run_summary(args.path, as_json=args.json)
        if args.trace_command == "capture":
            from obs.cli._trace_capture_view import run_capture

            return run_capture(args.path, steps=args.steps, level=args.level, timeout=args.timeout,
                               as_json=args.json)
        return _trace_view.run_export(args.path, endpoint=args.endpoint, protocol=args.protocol, as_json=args.json)
    if args.command == "graph":
        from obs.cli import _graph_view as graph_view

        if args.graph_command == "ls":
            return graph_view.run_ls(args.path, as_json=args.json)
        if args.graph_command == "show":
            return graph_view.run_show(args.file, as_json=args.json, top=args.top)
        if args.graph_command == "diff":
            return graph_view.run_diff(args.a, args.b, as_json=args.json)
        return graph_view.run_render(args.file, output=args.output, fmt=args.format)
    if args.command == "monitor":
        from obs.cli import _monitor_view as monitor_view

        if args.monitor_command == "show":
            return monitor_view.run_show(args.path, top=args.top, step=args.step, rows=args.rows, as_json=args.json)
        if args.monitor_command == "plot":
            return monitor_view.run_plot(args.path, html=args.html, columns=args.columns)
        return monitor_view.run_explain(args.path, step=args.step, span=args.span, limit=args.limit,
                                        as_json=args.json)
    if args.command == "native":
        from obs.cli._native_view import run_native

        return run_native(build=args.native_command == "build", as_json=args.json)
    if args.command == "run":
        from obs.cli._run import run_script

        if args.script is None:
            args.usage_error("a script to run is required: obs run [--config FILE] [--set KEY=VALUE] "
                                        "SCRIPT [ARGS...]")
        return run_script(args.script, args.args, config=args.config, sets=args.sets)
    if args.command == "demo":
        from obs.cli._demo import run_demo_command

        return run_demo_command(args.steps, config=args.config, sets=args.sets, as_json=args.json,
                                fail_at=args.fail_at)
    raise AssertionError(f"unknown command {args.command!r}")  # argparse rejects it first

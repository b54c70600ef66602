"""``obs demo``: train a small MLP on synthetic data with obs's features on, then say what each wrote.

With no settings (no ``--config``, ``--set`` or ``$OBS_CONFIG``) it is a tour: every file feature on,
written into ``./obs_demo/`` (replaced on each run; a folder of that name that obs did not make is
never touched): an RDR bundle from a fault it injects at the end, the profiler's Perfetto trace and
OTLP JSON lines, a print file, the graphs of its compiled model and a statistic dump of its last step.
The settings it used are in ``obs_demo/obs_config*.json``, and the model and training step it ran in
``obs_demo/train.py`` (a copy of :mod:`obs.cli._demo_train`), where the fault is raised, as in a user's script.
With settings, it runs with exactly those and writes only what they ask for.

Output: the summary and the commands that open what it wrote (one per line, never wrapped) on
stdout; on a terminal, a transient progress bar on stderr while it runs; at the end, on stderr,
every file obs wrote.  Step time is reported in steady state, apart from the first steps
(compilation, allocator and cache warm-up), which can be a hundred times slower.
"""

from __future__ import annotations

import atexit
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from obs._core import env
from obs.cli._demo_folder import DEMO_FOLDER, Tour, load_script, prepare_folder

__all__ = ["WARMUP_STEPS", "DemoResult", "run_demo", "run_demo_command"]

#: Steps left out of the steady-state step time (and reported on their own).
WARMUP_STEPS = 5

Progress = Callable[[str, int], None]  #: ``(what, steps done)``


@dataclass
class DemoResult:
    device: str
    steps: int
    first_loss: float
    last_loss: float
    step_ms: float  #: median step time in steady state (after the first steps)
    first_steps_ms: list[float]  #: the first steps, one by one (compilation, warm-up)
    events: dict[str, int]
    hooks: dict[str, bool]
    settings: dict[str, Any]
    env_config: dict[str, Any]
    produced: list[str] = field(default_factory=list)
    next_commands: list[str] = field(default_factory=list)
    #: what was written, by kind (absolute paths): folder, script, env_config, rdr_bundle, perfetto_trace,
    #: otlp_json_lines, print_file, graphs, data_dump, ... (only what exists)
    outputs: dict[str, str] = field(default_factory=dict)
    #: the fault the tour injects at the end (expected; the RDR bundle is in ``outputs``), or None
    fault: str | None = None


class DemoFailure(RuntimeError):
    """The failure the demo injects into the model's forward (``--fail-at N``, or at the end of the tour)."""


def split_warmup(durations_ns: list[int]) -> tuple[list[float], float]:
    """``(first steps' ms, steady-state median ms)``: up to WARMUP_STEPS first steps, keeping one for the median."""
    if not durations_ns:
        return [], 0.0
    warm = min(WARMUP_STEPS, len(durations_ns) - 1)
    return [d / 1e6 for d in durations_ns[:warm]], statistics.median(durations_ns[warm:]) / 1e6


# -- training ---------------------------------------------------------------------------------------

def run_demo(steps: int, fail_at: int | None = None, progress: Progress | None = None,
             tour: Tour | None = None) -> DemoResult:
    """Train for ``steps`` steps; count what the bus saw; raise DemoFailure in forward at step ``fail_at``.

    With ``tour`` (its settings already in force): the last step runs with the data dump on, and a
    fault is injected in a forward after training (the RDR writes a bundle; nothing raises here).
    ``progress(what, done)`` is called before training and after every step.
    """
    from obs.runtime import torch_support

    if not torch_support.importable():
        raise RuntimeError("obs demo needs PyTorch: pip install 'obs-runtime[torch]' (torch==2.13.0 for CPU)")
    import torch

    import obs
    from obs.runtime.steps import tracker
    from obs.runtime.torch import adapter
    from obs.settings._context import snapshot

    if steps < 1:
        raise ValueError(f"--steps must be at least 1 (got {steps})")
    report = progress or (lambda what, done: None)
    report("training", 0)
    torch.manual_seed(0)
    dev = obs.device()

    script = load_script(tour)
    model = script.build_model().to(dev)
    fault = next(m for m in model.modules() if isinstance(m, script.Fault))
    compiled = obs.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = script.training_data(dev)
    counts: Counter[str] = Counter()
    durations: list[int] = []

    def on_step_end(step: int, duration_ns: int) -> None:
        counts["step_end"] += 1
        durations.append(duration_ns)

    def on_module(scope: str, module: Any) -> None:
        counts["module_enter"] += 1

    print_file = obs.get_context("print_file_path")
    losses = []
    with obs.subscribe(obs.Event.STEP_END, on_step_end), obs.subscribe(obs.Event.MODULE_ENTER, on_module):
        hooks = dict(adapter.installed)
        for i in range(steps):
            if tour is not None and i == steps - 1:
                report("the last step, with the data dump", i)
                tour.start_dump(tracker.step)  # the next step's iteration: iterations count from 0, steps from 1
            net = compiled if tour is None or i < steps - 1 else model  # the dumped step runs eagerly anyway
            if fail_at is not None and tracker.step + 1 == fail_at:  # in eager: a compiled model is not retraced
                fault.error, net = DemoFailure(f"injected failure at step {fail_at} (obs demo --fail-at)"), model
            batch = slice((i * 64) % 512, (i * 64) % 512 + 64)
            loss = script.train_step(net, opt, x[batch], y[batch])
            losses.append(loss.item())
            if print_file and i % 10 == 0:
                obs.Print(f"step {i + 1} loss:", loss.detach(), "first layer bias:", model.state_dict()["0.bias"][:4])
            report("training", i + 1)
        injected = None
        if tour is not None:
            report("injecting a fault", steps)
            injected = _inject_fault(script, model, fault, x[:8])
    first_steps_ms, step_ms = split_warmup(durations)
    result = DemoResult(
        device=str(dev), steps=steps, first_loss=losses[0], last_loss=losses[-1],
        step_ms=step_ms, first_steps_ms=first_steps_ms, events=dict(counts),
        hooks=hooks, settings={k: v for k, v in snapshot().items()}, env_config=obs.env_config(), fault=injected)
    if tour is not None:
        result.outputs = _tour_outputs(tour)
    else:
        result.next_commands = ["obs options", "obs config check obs_config.json",
                                "obs run --config obs_config.json your_train.py"]
        _point_to_outputs(print_file, result)
    return result


def _inject_fault(script: Any, model: Any, fault: Any, x: Any) -> str:
    """An evaluation forward that raises in a module of the script: the Running Data Recorder writes a bundle of it."""
    fault.error = DemoFailure("injected failure after training (obs demo's fault for the Running Data Recorder)")
    try:
        script.evaluate(model, x)
    except DemoFailure as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        fault.error = None
    raise RuntimeError("obs demo: the injected fault did not raise")  # pragma: no cover - Fault always raises


def _tour_outputs(tour: Tour) -> dict[str, str]:
    """What the tour's features are writing, read from them while they are on (checked on disk later)."""
    import obs
    from obs.features.printing import feature as printing

    outputs = {"folder": tour.folder, "script": tour.script, "env_config": tour.config,
               "env_config_with_dump": tour.dump_config}
    live = obs.rdr.recorder()
    if live is not None and live.dumps:
        outputs["rdr_bundle"] = live.dumps[-1]
    if printing.path:
        outputs["print_file"] = printing.path
    outputs.update(_profile_outputs())
    graphs = obs.graphs.feature.files()
    if graphs.entries:
        outputs["graphs"] = graphs.folder
        outputs["graph"] = os.path.join(graphs.folder, graphs.entries[0]["files"]["ir"])
    outputs["data_dump"] = tour.at("dump")
    return outputs


def _profile_outputs() -> dict[str, str]:
    import obs

    live = obs.profiling.session()
    if live is None or _otlp_endpoint(live):
        return {}
    return {"perfetto_trace": os.path.join(live.folder, "trace.json"),
            "otlp_json_lines": os.path.join(live.folder, "traces.otlp.jsonl")}


def _otlp_endpoint(live: Any) -> str:
    return (live.request.endpoint or env.text(env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
            or env.text(env.OTEL_EXPORTER_OTLP_ENDPOINT))


# -- where things went: with settings ---------------------------------------------------------------

def _point_to_outputs(print_file: str, result: DemoResult) -> None:
    import obs

    produced, next_commands, outputs = result.produced, result.next_commands, result.outputs
    if print_file:
        from obs.features.printing import feature

        written = feature.path or print_file
        produced.append(f"{written} (Print records)")
        outputs["print_file"] = written
        next_commands.insert(0, f"obs print {written}")
    else:
        next_commands.insert(0, "obs demo --set print_file_path=demo_print.pb")
    _point_to_profile(result)
    live = obs.rdr.recorder()
    if live is not None:
        when = "on faults and at exit" if live.config.mode == 2 else "on faults (try --fail-at 20)"
        produced.append(f"{live.dir} (RDR ring while it runs, gone after a clean exit with nothing to report; "
                        f"bundles {when})")
        outputs["rdr"] = live.dir
        next_commands.insert(0, f"obs rdr ls {live.config.path or '.'}   # bundles, written {when}")
    else:
        next_commands.insert(1, "obs demo --config obs_config.json --fail-at 20   # with rdr.enable true in the file")
    _point_to_graphs(result)


def _point_to_graphs(result: DemoResult) -> None:
    from obs.features.graphs import feature

    if feature.level == 0:
        result.next_commands.append("obs demo --set save_graphs=2   # graph/IR dumps: .ir files, verbose copies")
        return
    files = feature.files()
    entries = files.entries
    if not entries:
        return
    stages = ", ".join(sorted({e["stage"] for e in entries}))
    result.produced.append(f"{files.folder} ({len(entries)} graph(s): {stages}; index.json lists them)")
    result.outputs["graphs"] = files.folder
    first = entries[0]["files"]
    commands = [f"obs graph ls {files.folder}", f"obs graph show {os.path.join(files.folder, first['ir'])}"]
    if "dot" in first:
        commands.append(f"obs graph render {os.path.join(files.folder, first['dot'])}")
    result.next_commands[0:0] = commands


def _point_to_profile(result: DemoResult) -> None:
    from obs import profiling

    live = profiling.session()
    if live is None:
        return
    if _otlp_endpoint(live):
        result.produced.append(f"spans sent over OTLP (summary in {live.folder}, at exit)")
    else:
        result.produced.append(f"{live.folder}/trace.json (open it in https://ui.perfetto.dev) and "
                               "traces.otlp.jsonl, written by the exporter process as steps end")
        result.outputs.update(_profile_outputs())
    result.next_commands.insert(0, f"obs trace summary {live.request.output}")


# -- where things went: the tour --------------------------------------------------------------------

#: (key in outputs, what it is, the command that opens it, a note)
_TOUR_COMMANDS = (
    ("script", "training script: the injected fault is raised in it", "", ""),
    ("rdr_bundle", "RDR bundle", "obs rdr show {}", "the RDR bundle of the fault injected at the end"),
    ("perfetto_trace", "Perfetto trace", "obs trace summary {}", "Perfetto trace: or open it in "
     "https://ui.perfetto.dev"),
    ("otlp_json_lines", "OTLP JSON lines", "obs trace summary {}", "the profiler's spans as OTLP JSON lines "
     "(obs trace export re-sends them)"),
    ("print_file", "print file", "obs print {}", "what obs.Print wrote"),
    ("graphs", "graphs", "obs graph ls {}", "the compiled model's graphs (save_graphs=2)"),
    ("graph", "", "obs graph show {}", ""),
    ("data_dump", "statistic dump", "obs dump ls {}", "the statistic dump of the last step"),
    ("data_dump", "", "obs dump stats {} --limit 12", ""),
    ("env_config_with_dump", "", "obs config check {}", "the settings the demo ran with"),
)


def _finish_tour(result: DemoResult) -> None:
    """After the features closed: keep the outputs that are on disk and name the command that opens each."""
    result.outputs = {k: v for k, v in result.outputs.items() if os.path.exists(v)}
    for key, what, command, note in _TOUR_COMMANDS:
        path = result.outputs.get(key)
        if path is None:
            continue
        shown = _shown(path)
        if what:
            result.produced.append(f"{shown} ({what})")
        if command:
            result.next_commands.append(command.format(shlex.quote(shown)) + (f"   # {note}" if note else ""))
    result.next_commands += [f"obs run --config obs_config.json your_train.py   # your script: start from a copy of "
                             f"{_shown(result.outputs.get('env_config', 'obs_config.json'))}",
                             "obs options   # every setting"]


def _shown(path: str) -> str:
    """``path`` relative to the current folder when it is inside it (``obs_demo/...``), else absolute."""
    relative = os.path.relpath(path)
    return path if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def _say_written(before: int) -> None:
    """On stderr, what obs wrote since ``before`` items (as ``obs run`` says at exit)."""
    from obs._core.outputs import written
    from obs.cli._render import say_written

    for kind, path in written()[before:]:
        say_written(kind, path)


# -- the command ------------------------------------------------------------------------------------

@contextmanager
def _progress_bar(steps: int) -> Iterator[Progress | None]:
    """A transient rich progress bar on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from obs.cli._render import err_console

    bar = Progress(SpinnerColumn(), TextColumn("obs demo: {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=err_console(), transient=True)
    task = bar.add_task("importing PyTorch", total=steps)
    with bar:
        yield lambda what, done: bar.update(task, description=what, completed=done)


def run_demo_command(steps: int, *, config: str | None, sets: list[tuple[str, Any]], as_json: bool,
                     fail_at: int | None = None) -> int:
    if config or sets or env.text(env.OBS_CONFIG):
        return _run_with_settings(steps, config=config, sets=sets, as_json=as_json, fail_at=fail_at)
    return _run_tour(steps, as_json=as_json, fail_at=fail_at)


def _run_with_settings(steps: int, *, config: str | None, sets: list[tuple[str, Any]], as_json: bool,
                       fail_at: int | None) -> int:
    from obs.cli._run import apply_settings, say_what_obs_wrote

    # Registered before any obs exit handler, so it runs after them (a mode-2 bundle, the last fsync).
    atexit.register(say_what_obs_wrote)
    from obs import profiling
    from obs.cli._trace_view import print_exit_summary

    profiling.feature.exit_listeners.append(print_exit_summary)  # the profile's summary at the end, when on
    apply_settings(config, sets)
    start = time.perf_counter()
    try:
        with _progress_bar(steps) as progress:
            result = run_demo(steps, fail_at, progress)
    except DemoFailure as exc:
        return _report_failure(exc, as_json=as_json)
    elapsed = time.perf_counter() - start
    return _report(result, elapsed, as_json=as_json)


def _run_tour(steps: int, *, as_json: bool, fail_at: int | None) -> int:
    """Every feature on, into ./obs_demo/; everything closed (files complete) before the report."""
    import obs
    from obs._core.outputs import written

    if steps < 2:
        raise ValueError(f"--steps must be at least 2 without --config or --set (got {steps}): the compiled model "
                         "trains first, then the last step is dumped")
    before = len(written())
    tour = Tour(prepare_folder(DEMO_FOLDER))
    start = time.perf_counter()
    failed: int | None = None
    try:
        tour.start()
        with _progress_bar(steps) as progress:
            result = run_demo(steps, fail_at, progress, tour)
    except DemoFailure as exc:  # --fail-at: a step failed, as asked
        failed = _report_failure(exc, as_json=as_json)
    finally:
        elapsed = time.perf_counter() - start
        obs.reset_context()  # closes every feature: the trace exported, the print file synced, the ring removed
    if failed is None:
        _finish_tour(result)
        failed = _report(result, elapsed, as_json=as_json)
    _say_written(before)
    return failed


def _report(result: DemoResult, elapsed: float, *, as_json: bool) -> int:
    if as_json:
        from obs.cli._render import print_json

        print_json(asdict(result))
        return 0
    from rich.panel import Panel
    from rich.table import Table

    from obs.cli._render import console, markup_text

    out = console()
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("device", result.device)
    table.add_row("steps", f"{result.steps} in {elapsed:.2f}s")
    table.add_row("step time", _step_time(result))
    table.add_row("loss", f"{result.first_loss:.4f} → {result.last_loss:.4f}")
    table.add_row("events seen", ", ".join(f"{k}={v}" for k, v in sorted(result.events.items())))
    table.add_row("hooks installed", ", ".join(k for k, v in result.hooks.items() if v) or "none")
    table.add_row("settings", markup_text(", ".join(f"{k}={v!r}" for k, v in result.settings.items()) or "defaults"))
    rdr = result.env_config["rdr"]
    table.add_row("rdr", markup_text(f"enable={rdr['enable']} mode={rdr['mode']} path={rdr['path'] or '.'}"))
    if result.fault is None:
        table.add_row("produced", markup_text(", ".join(result.produced)) or "nothing on disk (no file feature on)")
    else:  # the tour: its paths are listed below, whole
        table.add_row("produced", f"./{DEMO_FOLDER}/ (replaced on each run), listed below")
    out.print(Panel(table, title="obs demo", expand=False))
    if result.fault is not None:
        kept = ("the Running Data Recorder wrote a bundle of it" if "rdr_bundle" in result.outputs
                else "but the Running Data Recorder wrote no bundle of it (see the warnings above)")
        out.print(f"The fault injected at the end was expected ({markup_text(result.fault)}); {kept}.",
                  soft_wrap=True)
        out.print(f"In ./{DEMO_FOLDER}/:")
        for line in result.produced:
            out.print(f"  {markup_text(line)}", soft_wrap=True, highlight=False)
    _print_next(out, result.next_commands)
    return 0


def _step_time(result: DemoResult) -> str:
    if not result.first_steps_ms:
        return f"{result.step_ms:.2f} ms"
    first = ", ".join(f"{ms:.2f}" for ms in result.first_steps_ms)
    n = len(result.first_steps_ms)
    return (f"{result.step_ms:.2f} ms median in steady state (steps {n + 1}–{result.steps}); "
            f"the first {n}: {first} ms (compilation, warm-up)")


def _print_next(out: Any, commands: list[str]) -> None:
    """``Next:`` and each command on its own line, whole (soft wrap: rich never breaks it)."""
    from obs.cli._render import markup_text

    out.print("Next:")
    for command in commands:
        text, _, note = command.partition("   # ")
        line = f"  [cyan]{markup_text(text)}[/]" + (f"   [dim]# {markup_text(note)}[/]" if note else "")
        out.print(line, soft_wrap=True, highlight=False)


def _report_failure(exc: DemoFailure, *, as_json: bool) -> int:
    """The failure ``--fail-at`` injected: say where the RDR bundle is (if the recorder is on) and exit 1."""
    import obs

    live = obs.rdr.recorder()
    bundle = live.dumps[-1] if live is not None and live.dumps else None
    if as_json:
        from obs.cli._render import print_json

        print_json({"failed": str(exc), "bundle": bundle})
        return 1
    from obs.cli._render import console, error, markup_text

    error(str(exc))
    out = console()
    if bundle:
        out.print(f"RDR wrote [bold]{markup_text(bundle)}[/]", soft_wrap=True)
        _print_next(out, [f"obs rdr show {bundle}"])
    else:
        out.print("Turn the Running Data Recorder on to get a post-mortem bundle:", soft_wrap=True)
        _print_next(out, ["obs demo --fail-at 20 --config obs_config.json   # with rdr.enable true in the file"])
    return 1

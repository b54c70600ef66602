"""``obs demo``: train a small MLP on synthetic data with the configured features, then say what happened.

Output: the summary and the next commands (one per line, never wrapped) on stdout; on a terminal,
a transient progress bar on stderr while it runs; at exit, on stderr, every file obs wrote.  It
writes nothing into the current folder unless the settings ask for it (``print_file_path``, an
RDR path).  Step time is reported in steady state, apart from the first steps (compilation,
allocator and cache warm-up), which can be a hundred times slower.
"""

from __future__ import annotations

import atexit
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

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


class DemoFailure(RuntimeError):
    """The failure ``obs demo --fail-at N`` injects into the model's forward."""


def split_warmup(durations_ns: list[int]) -> tuple[list[float], float]:
    """``(first steps' ms, steady-state median ms)``: up to WARMUP_STEPS first steps, always keeping one for the median."""
    if not durations_ns:
        return [], 0.0
    warm = min(WARMUP_STEPS, len(durations_ns) - 1)
    return [d / 1e6 for d in durations_ns[:warm]], statistics.median(durations_ns[warm:]) / 1e6


def run_demo(steps: int, fail_at: int | None = None, progress: Progress | None = None) -> DemoResult:
    """Train for ``steps`` steps; count what the bus saw; raise DemoFailure in forward at step ``fail_at``.

    ``progress(what, done)`` is called before training and after every step.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
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

    class Fail(torch.nn.Module):
        """Passes its input through; raises at step ``fail_at`` (an injected fault for the RDR tour)."""

        def forward(self, h: Any) -> Any:
            if fail_at is not None and tracker.step == fail_at:
                raise DemoFailure(f"injected failure at step {fail_at} (obs demo --fail-at)")
            return h

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), Fail(), torch.nn.Linear(64, 4)).to(dev)
    model = obs.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 32, device=dev)
    y = (x[:, :4] * 2.0 + 0.1 * torch.randn(512, 4, device=dev))
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
            batch = slice((i * 64) % 512, (i * 64) % 512 + 64)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if print_file and i % 10 == 0:
                obs.Print(f"step {i + 1} loss:", loss.detach(), "first layer bias:", model.state_dict()["0.bias"][:4])
            report("training", i + 1)
    produced, next_commands = [], ["obs options", "obs config check obs_config.json",
                                   "obs run --config obs_config.json your_train.py"]
    _point_to_outputs(print_file, produced, next_commands)
    first_steps_ms, step_ms = split_warmup(durations)
    return DemoResult(
        device=str(dev), steps=steps, first_loss=losses[0], last_loss=losses[-1],
        step_ms=step_ms, first_steps_ms=first_steps_ms, events=dict(counts),
        hooks=hooks, settings={k: v for k, v in snapshot().items()}, env_config=obs.env_config(),
        produced=produced, next_commands=next_commands)


def _point_to_outputs(print_file: str, produced: list[str], next_commands: list[str]) -> None:
    import obs

    if print_file:
        from obs.features.printing import feature

        written = feature.path or print_file
        produced.append(f"{written} (Print records)")
        next_commands.insert(0, f"obs print {written}")
    else:
        next_commands.insert(0, "obs demo --set print_file_path=demo_print.pb")
    _point_to_profile(produced, next_commands)
    live = obs.rdr.recorder()
    if live is not None:
        when = "on faults and at exit" if live.config.mode == 2 else "on faults (try --fail-at 20)"
        produced.append(f"{live.dir} (RDR ring while it runs, gone after a clean exit with nothing to report; "
                        f"bundles {when})")
        next_commands.insert(0, f"obs rdr ls {live.config.path or '.'}   # bundles, written {when}")
    else:
        next_commands.insert(1, "obs demo --config obs_config.json --fail-at 20   # with rdr.enable true in the file")
    _point_to_graphs(produced, next_commands)


def _point_to_graphs(produced: list[str], next_commands: list[str]) -> None:
    from obs.features.graphs import feature

    if feature.level == 0:
        next_commands.append("obs demo --set save_graphs=2   # graph/IR dumps: .ir files, verbose copies")
        return
    files = feature.files()
    entries = files.entries
    if not entries:
        return
    stages = ", ".join(sorted({e["stage"] for e in entries}))
    produced.append(f"{files.folder} ({len(entries)} graph(s): {stages}; index.json lists them)")
    first = entries[0]["files"]
    commands = [f"obs graph ls {files.folder}", f"obs graph show {os.path.join(files.folder, first['ir'])}"]
    if "dot" in first:
        commands.append(f"obs graph render {os.path.join(files.folder, first['dot'])}")
    next_commands[0:0] = commands


def _point_to_profile(produced: list[str], next_commands: list[str]) -> None:
    from obs import profiling

    live = profiling.session()
    if live is None:
        return
    if live.request.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        produced.append(f"spans sent over OTLP (summary in {live.folder}, at exit)")
    else:
        produced.append(f"{live.folder}/trace.json (open it in https://ui.perfetto.dev) and traces.otlp.jsonl, "
                        "written by the exporter process as steps end")
    next_commands.insert(0, f"obs trace summary {live.request.output}")


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
    finally:
        elapsed = time.perf_counter() - start
    if as_json:
        from obs.cli._render import print_json

        print_json(asdict(result))
        return 0
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from obs.cli._render import console

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
    table.add_row("settings", escape(", ".join(f"{k}={v!r}" for k, v in result.settings.items()) or "defaults"))
    rdr = result.env_config["rdr"]
    table.add_row("rdr", escape(f"enable={rdr['enable']} mode={rdr['mode']} path={rdr['path'] or '.'}"))
    table.add_row("produced", escape(", ".join(result.produced)) or "nothing on disk (no file feature on)")
    out.print(Panel(table, title="obs demo", expand=False))
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
    from rich.markup import escape

    out.print("Next:")
    for command in commands:
        text, _, note = command.partition("   # ")
        line = f"  [cyan]{escape(text)}[/]" + (f"   [dim]# {escape(note)}[/]" if note else "")
        out.print(line, soft_wrap=True, highlight=False)


def _report_failure(exc: DemoFailure, *, as_json: bool) -> int:
    """The injected failure: say where the RDR bundle is (if the recorder is on) and exit 1."""
    import obs

    live = obs.rdr.recorder()
    bundle = live.dumps[-1] if live is not None and live.dumps else None
    if as_json:
        from obs.cli._render import print_json

        print_json({"failed": str(exc), "bundle": bundle})
        return 1
    from rich.markup import escape

    from obs.cli._render import console, error

    error(str(exc))
    out = console()
    if bundle:
        out.print(f"RDR wrote [bold]{escape(bundle)}[/]", soft_wrap=True)
        _print_next(out, [f"obs rdr show {bundle}"])
    else:
        out.print("Turn the Running Data Recorder on to get a post-mortem bundle:", soft_wrap=True)
        _print_next(out, ["obs demo --fail-at 20 --config obs_config.json   # with rdr.enable true in the file"])
    return 1

"""``obs demo``: train a small MLP on synthetic data with the configured features, then say what happened."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DemoResult", "run_demo", "run_demo_command"]


@dataclass
class DemoResult:
    device: str
    steps: int
    first_loss: float
    last_loss: float
    median_step_ms: float
    events: dict[str, int]
    hooks: dict[str, bool]
    settings: dict[str, Any]
    env_config: dict[str, Any]
    produced: list[str] = field(default_factory=list)
    next_commands: list[str] = field(default_factory=list)


class DemoFailure(RuntimeError):
    """The failure ``obs demo --fail-at N`` injects into the model's forward."""


def run_demo(steps: int, fail_at: int | None = None) -> DemoResult:
    """Train for ``steps`` steps; count what the bus saw; raise DemoFailure in forward at step ``fail_at``."""
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
    produced, next_commands = [], ["obs options", "obs config check obs_config.json",
                                   "obs run your_train.py --config obs_config.json"]
    _point_to_outputs(print_file, produced, next_commands)
    return DemoResult(
        device=str(dev), steps=steps, first_loss=losses[0], last_loss=losses[-1],
        median_step_ms=statistics.median(durations) / 1e6 if durations else 0.0, events=dict(counts),
        hooks=hooks, settings={k: v for k, v in snapshot().items()}, env_config=obs.env_config(),
        produced=produced, next_commands=next_commands)


def _point_to_outputs(print_file: str, produced: list[str], next_commands: list[str]) -> None:
    import obs

    if print_file:
        from obs.printing import feature

        written = feature.writer.path if feature.writer is not None else print_file
        produced.append(f"{written} (Print records)")
        next_commands.insert(0, f"obs print {written}")
    else:
        next_commands.insert(0, "obs demo --set print_file_path=demo_print.pb")
    live = obs.rdr.recorder()
    if live is not None:
        produced.append(f"{live.dir} (RDR ring; bundles on faults"
                        f"{' and at exit' if live.config.mode == 2 else ''})")
        next_commands.insert(0, f"obs rdr ls {live.config.path or '.'}")
    else:
        next_commands.insert(1, "obs demo --config obs_config.json --fail-at 20  (rdr.enable true in the file)")


def run_demo_command(steps: int, *, config: str | None, sets: list[tuple[str, Any]], as_json: bool,
                     fail_at: int | None = None) -> int:
    from obs.cli._run import apply_settings

    apply_settings(config, sets)
    start = time.perf_counter()
    try:
        result = run_demo(steps, fail_at)
    except DemoFailure as exc:
        return _report_failure(exc, as_json=as_json)
    if as_json:
        from obs.cli._render import print_json

        print_json(asdict(result))
        return 0
    from rich.panel import Panel
    from rich.table import Table

    from obs.cli._render import console

    out = console()
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("device", result.device)
    table.add_row("steps", f"{result.steps} in {time.perf_counter() - start:.2f}s "
                           f"(median step {result.median_step_ms:.2f} ms)")
    table.add_row("loss", f"{result.first_loss:.4f} → {result.last_loss:.4f}")
    table.add_row("events seen", ", ".join(f"{k}={v}" for k, v in sorted(result.events.items())))
    table.add_row("hooks installed", ", ".join(k for k, v in result.hooks.items() if v) or "none")
    table.add_row("settings", ", ".join(f"{k}={v!r}" for k, v in result.settings.items()) or "defaults")
    rdr = result.env_config["rdr"]
    table.add_row("rdr", f"enable={rdr['enable']} mode={rdr['mode']} path={rdr['path'] or '.'}")
    table.add_row("produced", ", ".join(result.produced) or "nothing on disk yet (no file feature on)")
    out.print(Panel(table, title="obs demo", expand=False))
    out.print("Next: " + "  |  ".join(f"[cyan]{c}[/]" for c in result.next_commands))
    return 0


def _report_failure(exc: DemoFailure, *, as_json: bool) -> int:
    """The injected failure: say where the RDR bundle is (if the recorder is on) and exit 1."""
    import obs

    live = obs.rdr.recorder()
    bundle = live.dumps[-1] if live is not None and live.dumps else None
    if as_json:
        from obs.cli._render import print_json

        print_json({"failed": str(exc), "bundle": bundle})
        return 1
    from obs.cli._render import console, error

    error(str(exc))
    if bundle:
        console().print(f"RDR wrote [bold]{bundle}[/]\nNext: [cyan]obs rdr show {bundle}[/]", highlight=False,
                        soft_wrap=True)
    else:
        console().print("Turn the Running Data Recorder on to get a post-mortem bundle: "
                        "[cyan]obs demo --fail-at 20 --config obs_config.json[/] with rdr.enable true", highlight=False)
    return 1

"""``save_graphs`` wired to the settings: which graphs are written where, and the GRAPH_IR event.

The level in force is ``set_context(save_graphs=...)`` when not 0, else the env config file's ``graphs``
section (hot-reloaded), else ``MS_DEV_SAVE_GRAPHS`` (read when obs is imported; a bad value warns and
is ignored), else 0; the folder likewise (``save_graphs_path`` / ``graphs.save_graphs_path`` /
``MS_DEV_SAVE_GRAPHS_PATH`` / ``.``), with ``rank_{r}/`` under distributed training.  A change applies
to the graphs compiled after it.

- Level >= 1, or anyone subscribed to GRAPH_IR (the recorder): every graph ``obs.compile`` publishes
  (GRAPH_COMPILED) is turned into ``.ir`` text once; files are written at level >= 1 and GRAPH_IR is
  emitted for subscribers.  Nothing is subscribed otherwise.
- Level >= 1 in PYNATIVE mode: the first training step's aten ops become a trace graph
  (:mod:`obs.features.graphs.trace`); its interception is removed after that step.

``import obs`` stays light: torch is imported only when a graph arrives or a trace is armed.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from obs._core import env, safe_files
from obs._core.after_import import after_import
from obs._core.demands import demands
from obs._core.errors import ObsConfigError, shorten
from obs._core.events import Event, Subscription, bus
from obs._core.internal import report_internal_error, suppressed
from obs.features import env_config as env_feature
from obs.features.graphs.folder import GraphFiles, Written, graph_folder
from obs.runtime import torch_support

__all__ = ["ENV_LEVEL", "ENV_PATH", "GraphsFeature", "feature", "level", "parse_env"]

ENV_LEVEL, ENV_PATH = env.MS_DEV_SAVE_GRAPHS, env.MS_DEV_SAVE_GRAPHS_PATH


def parse_env(environ: Mapping[str, str]) -> tuple[int | None, str | None]:
    """``MS_DEV_SAVE_GRAPHS`` (0-3) and ``MS_DEV_SAVE_GRAPHS_PATH``, validated; None where unset."""
    raw = environ.get(ENV_LEVEL)
    value: int | None = None
    if raw is not None and raw.strip() != "":
        if raw.strip() not in ("0", "1", "2", "3"):
            raise ObsConfigError(f"environment variable {ENV_LEVEL} must be 0, 1, 2 or 3 (got {shorten(raw)})",
                                 option=ENV_LEVEL, value=raw, source=ENV_LEVEL)
        value = int(raw)
    path = environ.get(ENV_PATH) or None
    if path is not None:
        check_path(path, ENV_PATH, source=ENV_PATH)
    return value, path


def check_path(path: str, option: str, *, source: str = "set_context") -> str:
    """The absolute folder ``path``; raises ObsConfigError when it cannot hold graph files.  Creates nothing."""
    if "\0" in path:
        raise ObsConfigError(f"{option} must not contain a NUL character (got {shorten(path)})", option=option,
                             value=path, source=source)
    full = os.path.abspath(path)
    try:
        deepest = safe_files.check_dir(full)
    except OSError as exc:
        raise ObsConfigError(f"{option} {shorten(path)} cannot be a folder of graph files: {exc}", option=option,
                             value=path, source=source) from None
    if not os.access(deepest, os.W_OK | os.X_OK):
        raise ObsConfigError(f"{option} {shorten(path)}: no write permission on the directory {deepest!r}",
                             option=option, value=path, source=source)
    return full


class GraphsFeature:
    """Holds the level and folder in force and the subscriptions they need."""

    keys = frozenset({"save_graphs", "save_graphs_path", "mode"})

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.env_level, self.env_path = 0, "."
        self.level, self.path = 0, os.path.abspath(".")
        self.pynative = True
        self._files: dict[str, GraphFiles] = {}
        self._compiled: Subscription | None = None
        self._records: Subscription | None = None  # COMPILE_RECORD: every compile's graphs, breaks, recompiles
        self._exports: Any = None  # every torch.export program (obs.runtime.torch._exports)
        self._steps: Any = None  # the step demand held while compiles are listened to
        self._awaiting_torch = False
        self._trace: Any = None  # the armed tracer (obs.graphs.trace), until its step ends
        self.traced = False  #: the eager trace graph of this process was written
        bus.watch(self._on_bus)
        env_feature.feature.listeners.append(self._on_env_config)

    # -- settings ----------------------------------------------------------------------------
    def from_environment(self, environ: Mapping[str, str] = os.environ) -> None:
        """Read ``MS_DEV_SAVE_GRAPHS*`` (at import); a bad value warns and leaves graphs off."""
        from obs.settings._context import snapshot

        try:
            env_level, env_path = parse_env(environ)
            self.env_level, self.env_path = env_level or 0, env_path or "."
            self._apply(self.prepare(snapshot(), {}))
        except (ObsConfigError, OSError) as exc:
            from obs.features.env_config import ObsConfigWarning

            self.env_level, self.env_path = 0, "."
            warnings.warn(f"graph dumps stay off: {exc}", ObsConfigWarning, stacklevel=3)

    def _desired(self, values: Mapping[str, Any]) -> tuple[int, str, bool, str]:
        """Level, folder, PYNATIVE or not, and where the folder came from: set_context, else the env config
        file's ``graphs`` section, else ``MS_DEV_SAVE_GRAPHS*``, else the defaults."""
        cfg = env_feature.feature.current()
        section, origins = cfg.values.get("graphs", {}), cfg.origins.get("graphs", {})
        # set_context's value wins unless it is the default (0, "."), which a settings swap cannot tell from unset.
        level = values.get("save_graphs") or (section["save_graphs"] if origins.get("save_graphs") == "file"
                                              else self.env_level)
        if values.get("save_graphs_path", ".") != ".":
            path, source = values["save_graphs_path"], "save_graphs_path"
        elif origins.get("save_graphs_path") == "file" and section["save_graphs_path"]:
            path, source = section["save_graphs_path"], "graphs.save_graphs_path"
        else:
            path, source = self.env_path, ENV_PATH if self.env_path != "." else "save_graphs_path"
        return level, path, values.get("mode", 1) == 1, source

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> tuple[int, str, bool]:
        level, path, pynative, source = self._desired(values)
        return level, check_path(path, source) if level > 0 else os.path.abspath(path), pynative

    def _on_env_config(self) -> None:
        """The env config file changed (set_context or a hot reload, at a step boundary): its graphs section."""
        from obs.settings._context import snapshot

        self._apply(self.prepare(snapshot(), {}))

    def commit(self, prepared: tuple[int, str, bool], values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        # Again: an env config file committed by the same call (before this applier) may have changed it.
        self._apply(self.prepare(values, changes))

    def _apply(self, prepared: tuple[int, str, bool]) -> None:
        level, path, pynative = prepared
        if level > 0:
            safe_files.ensure_dir(path)  # as in MindSpore: the folder exists (0700) once the level is set
        with self._lock:
            self.level, self.path, self.pynative = level, os.path.abspath(path), pynative
        self.sync()

    def close(self) -> None:
        with self._lock:
            self.level, self.path, self.pynative = 0, os.path.abspath("."), True
            self.traced = False  # settings start over: the next level >= 1 traces a step again
        self.sync()

    # -- subscriptions -----------------------------------------------------------------------
    def _on_bus(self, event: Event) -> None:
        if event is Event.GRAPH_IR:
            self.sync()

    def sync(self) -> None:
        """Subscribe to what the level (and GRAPH_IR's subscribers) need, and nothing else."""
        with self._lock:
            want = self.level > 0 or bus.has_subscribers(Event.GRAPH_IR)
            if self._compiled is not None and not self._compiled.active:  # removed by bus.clear()
                self._compiled = None
            if self._trace is not None and not self._trace.armed:
                self._trace = None
            if want and self._compiled is None:
                self._compiled = bus.subscribe(Event.GRAPH_COMPILED, self._on_compiled)
            elif not want and self._compiled is not None:
                self._compiled.remove()
                self._compiled = None
            want_trace = self.level > 0 and self.pynative and not self.traced
            if want_trace and self._trace is None and torch_support.importable():
                from obs.features.graphs.trace import Tracer

                self._trace = Tracer(self._on_trace_done)
            elif not want_trace and self._trace is not None:
                self._trace.disarm()
                self._trace = None

            # Compiles need torch: listen once it is in (the tracer above may just have imported it).
            want_records = self.level > 0 and "torch" in sys.modules
            if self.level > 0 and not want_records and not self._awaiting_torch and torch_support.importable():
                self._awaiting_torch = True
                after_import("torch", self.sync)
            if self._records is not None and not self._records.active:
                self._records = None
            if want_records and self._records is None:
                from obs.features.graphs.compiles import CompileRecords
                from obs.runtime.steps import tracker
                from obs.runtime.torch import OWN_COMPILES

                handler = CompileRecords(self.files, self.write_logged, level, OWN_COMPILES, _next_step)
                self._records = bus.subscribe(Event.COMPILE_RECORD, handler.on_record)
                self._steps = tracker.require("save_graphs")  # each graph names the step it was compiled in
            elif not want_records and self._records is not None:
                self._records.remove()
                self._records = None
                if self._steps is not None:
                    self._steps.remove()
                    self._steps = None
            if want_records and self._exports is None:
                from obs.runtime.torch import ExportHook

                self._exports = ExportHook(self._on_export)
            elif not want_records and self._exports is not None:
                self._exports.remove()
                self._exports = None

    def _on_trace_done(self, doc: Any) -> None:
        with self._lock:
            self.traced, self._trace = True, None
        self.publish(doc, "trace", doc.entry)

    # -- graphs ------------------------------------------------------------------------------
    def _on_compiled(self, name: str, graph_module: Any, example_inputs: Any) -> None:
        from obs.features.graphs.describe import describe_compiled

        with suppressed():
            doc, stage = describe_compiled(name, graph_module)
        self.publish(doc, stage, name)

    def _on_export(self, program: Any) -> None:
        from obs.features.graphs.describe import describe_export

        doc, stage = describe_export(program, "program")  # an ExportedProgram keeps no name of its model
        self.publish(doc, stage, "program")

    def publish(self, doc: Any, stage: str, name: str, *, level: int | None = None) -> Written | None:
        """Write ``doc``'s files for the level in force (or ``level``) and emit GRAPH_IR; returns what was written."""
        from obs.features.graphs.ir_text import ir_text

        doc.attrs.setdefault("stage", stage)
        doc.attrs.setdefault("step", str(_next_step()))
        text = ir_text(doc)
        written = self._write(doc, text, stage, name, self.level if level is None else level)
        if bus.has_subscribers(Event.GRAPH_IR):
            bus.emit(Event.GRAPH_IR, name, stage, text)
        return written

    def write_logged(self, doc: Any, graph: str, name: str, meta: dict[str, Any]) -> Written | None:
        """Write the files of a graph a plain torch.compile logged (:mod:`obs.features.graphs.compiles`) at the
        level in force, indexed under ``graph`` with ``meta``; no GRAPH_IR, which carries obs.compile's graphs."""
        from obs.features.graphs.ir_text import ir_text

        doc.attrs.setdefault("step", str(meta["step"]))
        return self._write(doc, ir_text(doc), doc.attrs["stage"], name, self.level, graph=graph, meta=meta)

    def _write(self, doc: Any, text: str, stage: str, name: str, level: int, *, graph: str | None = None,
               meta: dict[str, Any] | None = None) -> Written | None:
        from obs.features.graphs.dot import dot_text
        from obs.features.graphs.ir_text import ir_text

        if level <= 0:
            return None
        try:
            return self.files().write(graph=graph or doc.entry, stage=stage, name=name, level=level, text=text,
                                      verbose=ir_text(doc, verbose=True) if level >= 2 else None,
                                      dot=dot_text(doc) if level >= 3 else None,
                                      meta={"step": int(doc.attrs["step"]), "compile": doc.attrs.get("compile", name),
                                            "nodes": sum(len(g.nodes) for g in doc.graphs), **(meta or {})})
        except OSError as exc:
            report_internal_error(f"save_graphs: writing {stage} graph {name}", exc)
            return None

    def files(self) -> GraphFiles:
        folder = graph_folder(self.path)
        with self._lock:
            found = self._files.get(folder)
            if found is None:
                found = self._files[folder] = GraphFiles(folder)
            return found


def _next_step() -> int:
    """The step a graph belongs to: the one running, or (compiled between steps) the next one."""
    from obs.runtime.steps import tracker

    return tracker.step if tracker.in_step else tracker.step + 1


feature = GraphsFeature()


def level() -> int:
    """The save_graphs level in force (set_context, else MS_DEV_SAVE_GRAPHS, else 0)."""
    return feature.level


demands.graph_level = level

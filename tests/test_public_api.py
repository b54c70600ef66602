"""The public surface is pinned, and `import obs` stays light."""

from __future__ import annotations

import subprocess
import sys

import exporters
import obs
import printsink
import recorder

OBS_ALL = [
    "COMPATIBLE", "DEBUG", "DeviceUnavailableError", "Event", "EventBus", "GRAPH_MODE", "HookValidationError", "LAX",
    "ObsConfigError", "ObsConfigWarning", "ObsError", "PYNATIVE_MODE", "Print", "ParallelMode", "RELEASE", "STRICT",
    "Subscription", "__version__", "bus", "compile", "device", "device_context", "dump", "dump_graph", "env_config",
    "get_auto_parallel_context", "get_context", "get_ps_context", "internal_error_counts", "ops", "parse_print",
    "graphs", "profiling", "rank", "rdr",
    "reset_auto_parallel_context", "reset_context", "reset_ps_context", "scalar", "set_auto_parallel_context",
    "set_context", "set_ps_context", "step", "steps", "subscribe", "world_size",
]


def test_obs_all_is_pinned_and_resolvable():
    assert sorted(obs.__all__) == sorted(OBS_ALL)
    for name in OBS_ALL:
        assert getattr(obs, name) is not None


def test_constants_match_the_originals():
    assert (obs.GRAPH_MODE, obs.PYNATIVE_MODE) == (0, 1)
    assert (obs.STRICT, obs.COMPATIBLE, obs.LAX, obs.RELEASE, obs.DEBUG) == (0, 1, 2, 0, 1)
    assert obs.get_context("mode") == obs.PYNATIVE_MODE


def test_other_top_level_packages_import():
    assert recorder.__all__ == [] and exporters.__all__ == []
    assert "parse_print" in printsink.__all__ and all(getattr(printsink, n) for n in printsink.__all__)


def test_import_obs_does_not_import_torch_opentelemetry_or_rich():
    code = ("import sys, obs; obs.set_context(save_graphs=1, mode=obs.GRAPH_MODE); "
            "print(sorted(m for m in ('torch', 'rich', 'opentelemetry', 'watchdog') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_readers_are_pure_they_import_neither_torch_nor_rich():
    readers = ("obs.features.dump.reader", "obs.features.graphs.reader", "printsink.reader", "recorder.bundle_reader",
               "exporters.trace_reader", "recorder.ring_reader")
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {readers!r}]; "
            "print(sorted(m for m in ('torch', 'rich', 'opentelemetry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dir_lists_the_lazy_names_and_no_leaked_helpers():
    names = dir(obs)
    assert {"compile", "device"} <= set(names)
    assert set(OBS_ALL) <= set(names)
    for leaked in ("Any", "annotations", "TYPE_CHECKING"):
        assert not hasattr(obs, leaked), leaked


def test_each_event_member_documents_its_own_arguments():
    import pydoc

    for event in obs.Event:
        assert event.__doc__.startswith(f"{event.name}({', '.join(event.spec.args)}): ")
        assert event.spec.doc in event.__doc__
    assert "duration_ns` is wall time" in pydoc.render_doc(obs.Event.STEP_END, renderer=pydoc.plaintext)


def test_the_public_namespaces_are_importable_as_module_paths_and_are_the_same_modules():
    code = ("import sys, obs; from obs.dump import DumpReader; import obs.dump.diff, obs.rdr, obs.profiling; "
            "from obs.device_context.gpu import op_precision; "
            "print(obs.dump.diff is sys.modules['obs.features.dump.diff'], obs.rdr is obs.features.rdr, "
            "DumpReader is obs.features.dump.reader.DumpReader, "
            "op_precision is sys.modules['obs.features.device_context.gpu.op_precision'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"] * 4

"""Autouse guards: reset global state, make internal errors loud, catch leaked threads.  And ``native_path``: a test
on each path, native and Python, of the parts it names (``@pytest.mark.native(PART, ...)``)."""

from __future__ import annotations

import importlib
import os
import signal
import threading

import pytest

import obs
from obs._core import env, native
from obs._core.internal import set_raise_internal_errors
from obs.cli._native_view import DECLARING
from obs.runtime.steps import tracker


def pytest_configure(config):
    config.addinivalue_line("markers", "native(*parts): the native_path fixture runs the test on the native path and "
                            "on the Python path of each part named (RECORDER, OPS, STATS, DUMP); no part: every part "
                            "at once (OBS_NATIVE=0)")
    # A suite started in the background by a shell without job control (`(cmd &)` in a script) inherits SIGINT
    # ignored, and an ignored signal stays ignored across exec: the signal tests' children, and their "as
    # without obs" baselines, would never see it. Give the suite the handler an interactive start has.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The files run in the order pytest_collection_modifyitems gives. pytest-xdist would reorder them by their count
    # of tests, most first, which put the files of one or two long tests (a compiled model, an exporter outage, a
    # torchrun job) last, one worker running them alone after the others had finished.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The files holding a ``slow`` test first, each file's tests together and in their order: under
    ``--dist loadfile`` the longest files start while the short ones are left to fill the workers' ends."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the collection order within each group


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory) -> str:
    """One Inductor cache folder for the suite's compiling subprocesses (``TORCHINDUCTOR_CACHE_DIR``): its C++
    headers and the kernels of a model compiled without obs are built once.  A graph with obs's taps is never taken
    from it by another process (the taps' cache key holds the process id), so each feature still compiles its own.
    Under pytest-xdist the workers share it (Inductor writes its cache entries atomically)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "inductor"
        shared.mkdir(exist_ok=True)
        return str(shared)
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture(autouse=True)
def _reset_obs():
    """Every test starts and ends with default settings, no subscriptions and no open step."""
    old = set_raise_internal_errors(True)
    obs.reset_context()
    obs.reset_auto_parallel_context()
    obs.reset_ps_context()
    tracker.reset()
    yield
    obs.reset_context()
    obs.bus.clear()
    tracker.reset()
    set_raise_internal_errors(old)


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch):
    """``os.fsync`` returns at once in the test process.  What it buys (the bytes on disk through a power cut) no
    test can see, and on a busy disk each call took 20 ms: the recorder's markers and bundles made it a minute of
    the suite.  A test that checks that obs fsyncs patches ``os.fsync`` itself (it still sees every call); the
    tests' subprocesses fsync for real."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture(autouse=True)
def _no_thread_leaks():
    """A test must stop every thread it started (watchers, workers)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    obs.reset_context()
    leaked = [t for t in threading.enumerate() if (t.ident not in before and t.is_alive() and not t.daemon)
              or (t.name.startswith("obs-") and t.ident not in before and t.is_alive())]
    assert not leaked, f"threads left running: {leaked}"


# -- the native and the Python path ------------------------------------------------------------------------------
# One switch rule (obs/_core/native.py): OBS_NATIVE=0 turns every native part off, OBS_NATIVE_<PART>=0 one part; both
# are read when a part is asked for, so a test switches them with monkeypatch.  A test (or a module, through
# ``pytestmark``) that takes ``native_path`` runs once on the native path ("native", skipped with the reason where
# a part is not built here) and once on the Python path of each part its ``native`` marker names ("python", or
# "python-<part>" when it names several).  Either way no switch of the outer environment is left to decide.

#: The modules that declare obs's native parts (importing one declares its extensions in native.EXTENSIONS).
NATIVE_DECLARING = DECLARING


def native_extensions() -> list:
    """Every extension obs declares (native.Installed and native.Extension)."""
    for module in NATIVE_DECLARING:
        importlib.import_module(module)
    return list(native.EXTENSIONS.values())


def native_unavailable(part: str) -> str | None:
    """Why ``part``'s native code cannot be used in this process (None when it can), with no switch set."""
    for ext in native_extensions():
        if ext.part == part and ext.load() is None:
            return f"{ext.name}: {ext.unavailable_reason() or 'not loaded'}"
    return None


def pytest_generate_tests(metafunc):
    if "native_path" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("native")
    parts = tuple(marker.args) if marker is not None and marker.args else (None,)
    unknown = [p for p in parts if p is not None and p not in native.PARTS]
    assert not unknown, f"@pytest.mark.native: unknown part(s) {unknown}; the parts are {list(native.PARTS)}"
    ids = ["native"] + (["python"] if len(parts) == 1 else [f"python-{p.lower()}" for p in parts])
    metafunc.parametrize("native_path", [("native", parts)] + [("python", (p,)) for p in parts], ids=ids,
                         indirect=True)


@pytest.fixture
def native_path(request, monkeypatch):
    """``"native"`` or ``"python"``: the path of the marked parts this run takes (see above)."""
    path, parts = request.param
    for name in (env.OBS_NATIVE, *map(native.switch_name, native.PARTS)):
        monkeypatch.delenv(name, raising=False)
    if path == "native":
        for part in parts if parts != (None,) else tuple(native.PARTS):
            why = native_unavailable(part)
            if why is not None:
                pytest.skip(f"the native path of {part} is not available here: {why}")
    else:
        (part,) = parts
        monkeypatch.setenv(env.OBS_NATIVE if part is None else native.switch_name(part), "0")
        on = [ext.name for ext in native_extensions() if part in (None, ext.part) and ext.load() is not None]
        assert not on, f"switched off, yet loaded: {on}"
        if part in (None, "STATS"):  # obs.features.dump.stats.tensor_stats reads its switch once, at import
            from obs.features.dump.stats import tensor_stats

            monkeypatch.setattr(tensor_stats, "native", None)
    return path

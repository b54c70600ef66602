"""graphviz: one call of Graphviz's dot, whose errors say whether it is missing, too slow or failing."""

from __future__ import annotations

import os

import pytest

from obs.features.graphs.graphviz import GraphvizError, render


@pytest.fixture(name="fake_dot")
def _fake_dot(tmp_path, monkeypatch):
    """Put a shell script in place of Graphviz's dot (none on the CI machines); returns a function writing it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")

    def write(body):
        dot = folder / "dot"
        dot.write_text(f"#!/bin/sh\n{body}\n")
        dot.chmod(0o755)

    return write


def test_dot_renders_what_it_is_given_in_the_format_asked(fake_dot):
    fake_dot('[ "$1" = -Tpng ] || exit 9; printf "<png>"; cat')
    assert render("digraph g { a -> b }", fmt="png") == b"<png>digraph g { a -> b }"


def test_without_dot_on_the_path_the_error_says_it_is_missing_and_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GraphvizError, match=r"'dot' program is not installed \(install Graphviz: apt install") as e:
        render("digraph g {}")
    assert e.value.missing


def test_a_failing_or_silent_dot_is_an_error_with_its_stderr(fake_dot):
    fake_dot('echo "syntax error in line 1" >&2; exit 3')
    with pytest.raises(GraphvizError, match=r"dot failed \(exit status 3\): syntax error in line 1") as e:
        render("digraph g {")
    assert not e.value.missing
    fake_dot("exit 0")
    with pytest.raises(GraphvizError, match=r"exit status 0\): no output"):
        render("digraph g {}")


def test_a_dot_that_runs_past_its_time_is_stopped(fake_dot):
    fake_dot("exec sleep 30")
    with pytest.raises(GraphvizError, match=r"took more than 0\.2 s"):
        render("digraph g {}", timeout_s=0.2)

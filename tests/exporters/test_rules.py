"""obs's Prometheus alerting rules: ``promtool check rules`` accepts them, ``promtool test rules`` passes
(obs-rules.test.yml: every alert fires on series made for it and stays quiet on healthy ones), and ``obs metrics
rules`` prints the file docs/prometheus/obs-rules.yml holds.

The promtool tests are skipped where no ``promtool`` is installed (Debian's ``prometheus`` package ships it;
``.ci/run`` installs it).  Whether the rules evaluate on a real job: tests/exporters/test_prometheus.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess

import pytest

from obs.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RULES = os.path.join(ROOT, "docs", "prometheus", "obs-rules.yml")
PACKAGED = os.path.join(ROOT, "exporters", "obs-rules.yml")
RULE_TESTS = os.path.join(HERE, "obs-rules.test.yml")
PROMTOOL = next((p for p in ("/usr/bin/promtool", shutil.which("promtool")) if p and os.access(p, os.X_OK)), None)
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool binary (apt-get install prometheus)")


def alerts() -> list[str]:
    with open(RULES) as fh:
        return re.findall(r"^\s+- alert: (\w+)$", fh.read(), re.M)


def test_obs_metrics_rules_prints_the_file_in_docs():
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["metrics", "rules"]) == 0
    with open(RULES) as docs, open(PACKAGED) as packaged:
        text = docs.read()
        assert out.getvalue() == text == packaged.read()
    assert alerts() == ["ObsRankHung", "ObsStraggler", "ObsThroughputDown", "ObsExporterDown", "ObsNonFinite",
                        "ObsMemoryClimbing", "ObsMonitorAnomaly"]
    assert "training-health monitor" in text


def test_every_alert_has_a_case_that_fires_and_one_that_does_not():
    with open(RULE_TESTS) as fh:
        text = fh.read()
    cases = re.findall(r"alertname: (\w+)\n\s+exp_alerts:( \[\])?", text)
    for name in alerts():
        outcomes = {quiet == "" for alert, quiet in cases if alert == name}
        assert outcomes == {True, False}, f"{name}: {outcomes}"


@needs_promtool
def test_promtool_checks_the_rules():
    done = subprocess.run([PROMTOOL, "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


@needs_promtool
def test_promtool_test_rules_passes():
    done = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS], capture_output=True, text=True, timeout=120,
                          cwd=HERE)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr

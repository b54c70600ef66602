"""``obs metrics rules``: print the Prometheus alerting rules obs ships (docs/prometheus/obs-rules.yml).

The rules file is package data of :mod:`exporters` (``exporters/obs-rules.yml``), printed as it is, to be saved
and named in Prometheus' ``rule_files``.  Exit 0.
"""

from __future__ import annotations

import sys
from importlib import resources

from obs.cli._exit import EXIT_OK

__all__ = ["rules_text", "run_rules"]


def rules_text() -> str:
    """The rules file's text."""
    return resources.files("exporters").joinpath("obs-rules.yml").read_text(encoding="utf-8")


def run_rules() -> int:
    sys.stdout.write(rules_text())
    sys.stdout.flush()
    return EXIT_OK

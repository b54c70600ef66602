"""Runs of ``train_script.py`` one after another in this one process, each as a run of its own would be: its own
current folder (so its own ``./obs_profile``), its own environment (OTEL_*), its steps counted from 1.  The end-to-end
tests start one trainer for several runs: a trainer's start-up (torch's import, the optimizer's) is most of what a
short run costs.

argv[1]: JSON list of ``{"name", "cwd", "env", "args"}`` (``args``: train_script.py's argument).  Each run begins
with the line ``phase NAME`` on stdout and on stderr; each but the last resets the context at its end (its exporter
drains and ends, its drops are warned) before the next begins; the last ends as the process does (or kills it).
"""

import json
import os
import runpy
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
phases = json.loads(sys.argv[1])
base = dict(os.environ)
for i, phase in enumerate(phases):
    os.environ.clear()
    os.environ.update({**base, **phase.get("env", {})})
    os.chdir(phase["cwd"])
    if i:  # the first run imports torch and obs itself, in train_script.py's order
        from obs.runtime.steps import tracker

        tracker.reset()
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"phase {phase['name']}\n")
        stream.flush()
    args = phase["args"] if i == len(phases) - 1 else {**phase["args"], "reset": True}
    sys.argv = [SCRIPT, json.dumps(args)]
    runpy.run_path(SCRIPT, run_name="__main__")

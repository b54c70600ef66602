"""Inductor compiles a model with each obs feature as it does without obs, and the losses are the same to the bit.

CI's slice of ``tests/obs/runtime/compiled_corpus.py``: one small graph holding BatchNorm in training (the graph
writes its running statistics), an in-place ReLU on a residual sum, LayerNorm, GELU, dropout, a buffer the forward
writes and views; trained without obs, with the NaN check at module granularity (module outputs tapped: the
setting that crashed Inductor's code) and with every feature at once (every node tapped).  The whole matrix,
ResNet-18 and a GPT-2 block among its models, is ``python -m tests.obs.runtime.compiled_corpus --all``.

About 40 s on an idle machine: three Inductor compiles of a forward and a backward graph, in one process (Inductor
keeps worker threads for the rest of a process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def test_features_leave_an_inductor_graph_with_batchnorm_as_it_was(tmp_path, inductor_cache):
    # "everything" asks for every node (the NaN check per op), which overrides the module check's own selection
    # (only values that leave their module): that selection, the one that crashed Inductor, needs its own compile
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": inductor_cache,
           "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tests.obs.runtime.compiled_corpus", "--models", "slice",
                           "--features", "nan_check module,everything", "--json"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode in (0, 1), done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])["slice"]
    plain = results["plain"]
    assert plain["frames"] == {"total": 1, "ok": 1} and not plain["breaks"]
    for feature in ("nan_check module", "everything"):
        assert results[feature]["losses"] == plain["losses"], feature  # every bit
        assert (results[feature]["frames"], results[feature]["breaks"]) == (plain["frames"], plain["breaks"]), feature

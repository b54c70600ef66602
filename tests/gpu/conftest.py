"""tests/gpu: collected everywhere, run where CUDA is (each test is marked ``cuda`` and skipped without it).

On a GPU machine: ``python -m pytest -q tests/gpu`` (or ``bash tests/gpu/device_checks.sh``, which also prints the
card, driver, CUDA and torch versions the results belong to).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason="needs CUDA (a GPU machine: bash tests/gpu/device_checks.sh)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)

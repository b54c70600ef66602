"""Module names from Dynamo's paths of them, as the monitor's compiled activations name their rows."""

from __future__ import annotations

import pytest

from obs.runtime.torch._module_io import module_name


@pytest.mark.parametrize(("path", "name"), [
    ("L['self'].fc1", "fc1"),
    ("L['fn'].2.fc", "2.fc"),
    ("L['self'].h[0]._modules['mlp']", "h.0.mlp"),
    ("L['self']._orig_mod.h.1.attn", "h.1.attn"),
    ("L['mod']", ""),
])
def test_a_module_is_named_under_the_compiled_module(path, name):
    assert module_name(path) == name

"""Shared path of the GPU knob functions: validate with gpu_config's own validator, then set it."""

from __future__ import annotations

import warnings
from typing import Any

from obs.settings._context import get_context, set_context
from obs.settings.context_options import CONTEXT_OPTIONS


def set_gpu_option(key: str, value: Any) -> None:
    check = CONTEXT_OPTIONS["gpu_config"].check.schema[key]  # type: ignore[attr-defined]
    checked = check(value, key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_context(gpu_config={key: checked})
    for w in caught:
        warnings.warn(str(w.message).replace("set_context: 'gpu_config'",
                                             f"obs.features.device_context.gpu {key}"), w.category, stacklevel=3)


def get_gpu_option(key: str) -> Any:
    return get_context("gpu_config").get(key, CONTEXT_OPTIONS["gpu_config"].check.defaults[key])  # type: ignore[attr-defined]

"""The device settings (device target and id, determinism, threads, gpu_config, ...): their applier.

It imports torch only when one of them is really used.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from obs.settings._table import canonical_device
from obs.settings.context_options import CONTEXT_OPTIONS

__all__ = ["TORCH_KEYS", "DeviceFeature", "feature"]

TORCH_KEYS = frozenset({"deterministic", "runtime_num_threads", "inter_op_parallel_num", "gpu_config",
                        "device_target", "device_id", "max_device_memory", "pynative_synchronize",
                        "reserve_class_name_in_scope"})


class DeviceFeature:
    """Checks devices before a call is accepted; applies and undoes the PyTorch controls."""

    keys = TORCH_KEYS

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        target = values.get("device_target", "CPU")
        if ("device_target" in changes or "device_id" in changes) and canonical_device(target) != "CPU":
            from obs.runtime.torch import check_device

            check_device(target, values.get("device_id", 0))

    def commit(self, prepared: None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        adapter = sys.modules.get("obs.runtime.torch")  # loaded: module scopes may be named already
        if "reserve_class_name_in_scope" in changes and adapter is not None:
            adapter.forget_scopes()
        needed = "torch" in sys.modules or any(
            new != CONTEXT_OPTIONS[key].default for key, (_, new) in changes.items() if key in TORCH_KEYS)
        if needed:
            from obs.runtime.torch import apply_controls

            apply_controls(values, changes)

    def close(self) -> None:
        adapter = sys.modules.get("obs.runtime.torch")  # not loaded: no control was applied
        if adapter is not None:
            adapter.restore_controls()


feature = DeviceFeature()

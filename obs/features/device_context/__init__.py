"""Per-device knobs in MindSpore's device_context layout: ``obs.device_context.gpu.op_tuning``, ``op_precision``."""

from obs.features.device_context import gpu

__all__ = ["gpu"]

"""Per-device knobs in the originals' layout: ``obs.features.device_context.gpu.op_tuning`` / ``op_precision``."""

from obs.features.device_context import gpu

__all__ = ["gpu"]

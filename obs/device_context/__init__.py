"""Per-device knobs in the originals' layout: ``obs.device_context.gpu.op_tuning`` / ``op_precision``."""

from obs.device_context import gpu

__all__ = ["gpu"]

"""``device_target`` / ``device_id`` → a real ``torch.device``, checked before it is accepted."""

from __future__ import annotations

import importlib.util

import torch

from obs._core.errors import DeviceUnavailableError
from obs.settings._table import canonical_device

__all__ = ["check_device", "device", "torch_device"]


def check_device(target: str, index: int) -> None:
    """Raise :class:`DeviceUnavailableError` unless ``target:index`` exists in this process."""
    target = canonical_device(target)
    if target == "CPU":
        return
    if target == "GPU":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device_target 'GPU' needs CUDA, but torch.cuda.is_available() is False (torch {torch.__version__},"
                f" CUDA build: {torch.version.cuda or 'none'}); use device_target='CPU'",
                option="device_target", value=target, source="set_context")
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceUnavailableError(f"'device_id' must be below the {count} visible CUDA device(s) "
                                         f"(got {index})", option="device_id", value=index, source="set_context")
        return
    if importlib.util.find_spec("torch_npu") is None:
        raise DeviceUnavailableError("device_target 'Ascend' needs the torch NPU backend (package torch_npu), "
                                     "which is not installed", option="device_target", value=target,
                                     source="set_context")
    import torch_npu  # noqa: F401  (registers the "npu" device type)

    count = torch.npu.device_count()  # type: ignore[attr-defined]
    if index >= count:
        raise DeviceUnavailableError(f"'device_id' must be below the {count} visible NPU device(s) (got {index})",
                                     option="device_id", value=index, source="set_context")


def torch_device(target: str, index: int) -> torch.device:
    target = canonical_device(target)
    if target == "CPU":
        return torch.device("cpu")
    return torch.device("cuda" if target == "GPU" else "npu", index)


def device() -> torch.device:
    """The device chosen by ``set_context(device_target=..., device_id=...)`` (CPU by default)."""
    from obs.settings._context import get_context

    return torch_device(get_context("device_target"), get_context("device_id"))

"""TF32 switches: ``torch.backends.cudnn.allow_tf32`` and ``torch.backends.cuda.matmul.allow_tf32``."""

from __future__ import annotations

from obs.features.device_context.gpu._common import get_gpu_option, set_gpu_option

__all__ = ["conv_allow_tf32", "get", "matmul_allow_tf32"]


def conv_allow_tf32(value: bool) -> None:
    """Allow TF32 in cuDNN convolutions (default True)."""
    set_gpu_option("conv_allow_tf32", value)


def matmul_allow_tf32(value: bool) -> None:
    """Allow TF32 in matrix multiplications (default False)."""
    set_gpu_option("matmul_allow_tf32", value)


def get(key: str) -> bool:
    """The value in force for ``conv_allow_tf32`` / ``matmul_allow_tf32``."""
    return get_gpu_option(key)  # type: ignore[no-any-return]

"""cuDNN convolution algorithm choice; "performance" turns on PyTorch's cuDNN benchmark mode."""

from __future__ import annotations

from obs.features.device_context.gpu._common import get_gpu_option, set_gpu_option

__all__ = ["conv_dgrad_algo", "conv_fprop_algo", "conv_wgrad_algo", "get"]


def conv_fprop_algo(mode: str) -> None:
    """Forward convolution algorithm: normal, performance, implicit_gemm, precomp_gemm, gemm, direct, fft, ..."""
    set_gpu_option("conv_fprop_algo", mode)


def conv_dgrad_algo(mode: str) -> None:
    """Data-gradient convolution algorithm: normal, performance, algo_0, algo_1, fft, fft_tiling, winograd, ..."""
    set_gpu_option("conv_dgrad_algo", mode)


def conv_wgrad_algo(mode: str) -> None:
    """Weight-gradient convolution algorithm: normal, performance, algo_0, algo_1, fft, algo_3, fft_tiling, ..."""
    set_gpu_option("conv_wgrad_algo", mode)


def get(key: str) -> str:
    """The algorithm in force for ``conv_fprop_algo`` / ``conv_dgrad_algo`` / ``conv_wgrad_algo``."""
    return get_gpu_option(key)  # type: ignore[no-any-return]

"""Settings with a PyTorch meaning, applied for real and undone by ``reset_context``.

The first change of a control saves PyTorch's previous state; :func:`restore` puts every saved
state back.  Thread pools cannot always be changed once parallel work started: then we warn.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from obs.runtime.torch._device import torch_device
from obs.settings._table import canonical_device

__all__ = ["apply", "restore"]

_saved: dict[str, Callable[[], None]] = {}


def _save(name: str, undo: Callable[[], None]) -> None:
    _saved.setdefault(name, undo)


def _get(values: Mapping[str, Any], key: str) -> Any:
    from obs.settings.context_options import CONTEXT_OPTIONS

    return values.get(key, CONTEXT_OPTIONS[key].default)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _deterministic(values: Mapping[str, Any]) -> None:
    cudnn = torch.backends.cudnn
    previous = (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark,
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    def undo() -> None:
        torch.use_deterministic_algorithms(previous[0])
        cudnn.deterministic, cudnn.benchmark = previous[1], previous[2]
        _set_env("CUBLAS_WORKSPACE_CONFIG", previous[3])

    _save("deterministic", undo)
    if _get(values, "deterministic") == "ON":
        # cuBLAS is only deterministic with a fixed workspace; torch raises without it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        cudnn.deterministic, cudnn.benchmark = True, False
    else:
        _saved.pop("deterministic")()


def _threads(values: Mapping[str, Any]) -> None:
    previous = torch.get_num_threads()
    _save("threads", lambda: torch.set_num_threads(previous))
    n = _get(values, "runtime_num_threads")
    if n > 0:
        torch.set_num_threads(n)
    else:
        _saved.pop("threads")()


def _interop(values: Mapping[str, Any]) -> None:
    n = _get(values, "inter_op_parallel_num")
    if n <= 0 or n == torch.get_num_interop_threads():
        return
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        warnings.warn(f"'inter_op_parallel_num'={n} cannot take effect: PyTorch fixes its inter-op pool once "
                      f"parallel work started (it stays at {torch.get_num_interop_threads()}); set it before "
                      f"training starts, e.g. via `obs run --set inter_op_parallel_num={n}`", UserWarning,
                      stacklevel=2)


def _gpu_config(values: Mapping[str, Any]) -> None:
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    previous = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark)

    def undo() -> None:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark = previous

    _save("gpu_config", undo)
    from obs.settings.context_options import CONTEXT_OPTIONS

    cfg = {**CONTEXT_OPTIONS["gpu_config"].check.defaults, **_get(values, "gpu_config")}  # type: ignore[attr-defined]
    cudnn.allow_tf32 = cfg["conv_allow_tf32"]
    matmul.allow_tf32 = cfg["matmul_allow_tf32"]
    # cuDNN's "performance" = try every algorithm and keep the fastest: PyTorch's benchmark mode.
    algos = [cfg[k] for k in ("conv_fprop_algo", "conv_dgrad_algo", "conv_wgrad_algo")]
    cudnn.benchmark = "performance" in algos


def _device(values: Mapping[str, Any]) -> None:
    target = canonical_device(_get(values, "device_target"))
    if target == "GPU":
        if torch.cuda.is_initialized():
            previous = torch.cuda.current_device()
            _save("device", lambda: torch.cuda.set_device(previous))
        torch.cuda.set_device(torch_device(target, _get(values, "device_id")))


def _max_device_memory(values: Mapping[str, Any]) -> None:
    target = canonical_device(_get(values, "device_target"))
    if target != "GPU":
        return
    index = _get(values, "device_id")
    _save("max_device_memory", lambda: torch.cuda.set_per_process_memory_fraction(1.0, index))
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, _get(values, "max_device_memory") * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def _synchronize(values: Mapping[str, Any]) -> None:
    previous = os.environ.get("CUDA_LAUNCH_BLOCKING")
    _save("pynative_synchronize", lambda: _set_env("CUDA_LAUNCH_BLOCKING", previous))
    if not _get(values, "pynative_synchronize"):
        _saved.pop("pynative_synchronize")()
        return
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    if torch.cuda.is_initialized():
        warnings.warn("'pynative_synchronize' takes effect for CUDA only when set before the first CUDA call; "
                      "CUDA is already initialised in this process, so kernels stay asynchronous. Set it first, "
                      "or run with `obs run --set pynative_synchronize=true`", UserWarning, stacklevel=2)


_CONTROLS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "deterministic": _deterministic,
    "runtime_num_threads": _threads,
    "inter_op_parallel_num": _interop,
    "gpu_config": _gpu_config,
    "device_target": _device,
    "device_id": _device,
    "max_device_memory": _max_device_memory,
    "pynative_synchronize": _synchronize,
}


def apply(values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
    """Apply each changed control once (device_target and device_id share one)."""
    done: set[Callable[[Mapping[str, Any]], None]] = set()
    for key in changes:
        control = _CONTROLS.get(key)
        if control is not None and control not in done:
            done.add(control)
            control(values)
    if "device_target" in changes or "device_id" in changes:
        done.add(_max_device_memory)
        if "max_device_memory" in values:
            _max_device_memory(values)


def restore() -> None:
    """Undo every control, newest first."""
    while _saved:
        _, undo = _saved.popitem()
        undo()

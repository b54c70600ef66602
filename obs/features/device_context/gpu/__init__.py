"""GPU knobs: cuDNN algorithm choice (op_tuning) and TF32 switches (op_precision)."""

from obs.features.device_context.gpu import op_precision, op_tuning
from obs.features.device_context.gpu.op_precision import conv_allow_tf32, matmul_allow_tf32
from obs.features.device_context.gpu.op_tuning import conv_dgrad_algo, conv_fprop_algo, conv_wgrad_algo

__all__ = ["conv_allow_tf32", "conv_dgrad_algo", "conv_fprop_algo", "conv_wgrad_algo", "matmul_allow_tf32",
           "op_precision", "op_tuning"]

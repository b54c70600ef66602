"""The rows of ``set_context``: every key of MindSpore's ``set_context``, old and new, declared once.

Adding an option is adding one row here; validation, ``get_context`` defaults, ``obs options``
and the README table all follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from obs.settings._table import Option, OptionTable
from obs.settings._validators import (
    Bool,
    Choice,
    Dict,
    ExistingFile,
    Int,
    Mapped,
    SaveGraphsLevel,
    Size,
    Str,
    Validator,
    fail,
    type_fail,
)
from obs.settings.profiler_options import ProfilingOptions

__all__ = ["CONTEXT_OPTIONS", "GRAPH_MODE", "PYNATIVE_MODE", "STRICT", "COMPATIBLE", "LAX", "RELEASE", "DEBUG",
           "CONV_FPROP_ALGOS", "CONV_DGRAD_ALGOS", "CONV_WGRAD_ALGOS"]

GRAPH_MODE, PYNATIVE_MODE = 0, 1
STRICT, COMPATIBLE, LAX = 0, 1, 2
RELEASE, DEBUG = 0, 1

GPU = frozenset({"GPU"})
ASCEND = frozenset({"Ascend"})
GPU_ASCEND = frozenset({"GPU", "Ascend"})

CONV_FPROP_ALGOS = ("normal", "performance", "implicit_gemm", "precomp_gemm", "gemm", "direct", "fft", "fft_tiling",
                    "winograd", "winograd_nonfused")
CONV_DGRAD_ALGOS = ("normal", "performance", "algo_0", "algo_1", "fft", "fft_tiling", "winograd", "winograd_nonfused")
CONV_WGRAD_ALGOS = ("normal", "performance", "algo_0", "algo_1", "fft", "algo_3", "fft_tiling", "winograd_nonfused")

PRECISION_MODES = ("force_fp16", "allow_fp32_to_fp16", "allow_mix_precision", "must_keep_origin_dtype", "force_fp32",
                   "allow_fp32_to_bf16", "allow_mix_precision_fp16", "allow_mix_precision_bf16")


@dataclass(frozen=True)
class GeOptions(Validator):
    """``{"global": {str: str}, "session": {str: str}}`` handed to the graph engine."""

    def __call__(self, value: Any, name: str) -> dict[str, dict[str, str]]:
        if not isinstance(value, dict):
            raise type_fail(name, "a dict with keys 'global' and/or 'session'", value)
        out = {}
        for scope, opts in value.items():
            if scope not in ("global", "session"):
                raise fail(f"{name}", "a dict whose keys are 'global' or 'session'", scope)
            if not isinstance(opts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in opts.items()):
                raise type_fail(f"{name}.{scope}", "a dict of str to str", opts)
            out[scope] = dict(opts)
        return out

    def describe(self) -> str:
        return "dict: global, session"


_ASCEND_CONFIG = Dict(
    schema={
        "precision_mode": Choice(PRECISION_MODES),
        "jit_compile": Bool(),
        "atomic_clean_policy": Choice((0, 1)),
        "matmul_allow_hf32": Bool(),
        "conv_allow_hf32": Bool(),
        "op_precision_mode": Str(non_empty=True),
        "host_scheduling_max_threshold": Int(min=0),
        "ge_options": GeOptions(),
        "parallel_speed_up_json_path": Str(non_empty=True),
        "hccl_watchdog": Bool(),
        "op_debug_option": Choice(("oom",)),
        "exception_dump": Choice(("0", "1", "2")),
    },
    # exception_dump is implemented on every device (the failing op's inputs/outputs).
    devices={k: ASCEND for k in ("precision_mode", "jit_compile", "atomic_clean_policy", "matmul_allow_hf32",
                                 "conv_allow_hf32", "op_precision_mode", "host_scheduling_max_threshold",
                                 "ge_options", "parallel_speed_up_json_path", "hccl_watchdog", "op_debug_option")},
    defaults={"exception_dump": "2"},
)

_GPU_CONFIG = Dict(
    schema={
        "conv_fprop_algo": Choice(CONV_FPROP_ALGOS),
        "conv_dgrad_algo": Choice(CONV_DGRAD_ALGOS),
        "conv_wgrad_algo": Choice(CONV_WGRAD_ALGOS),
        "conv_allow_tf32": Bool(),
        "matmul_allow_tf32": Bool(),
    },
    defaults={"conv_fprop_algo": "normal", "conv_dgrad_algo": "normal", "conv_wgrad_algo": "normal",
              "conv_allow_tf32": True, "matmul_allow_tf32": False},
)

_NO_EFFECT = "it has no effect and can be removed"

CONTEXT_OPTIONS = OptionTable("set_context", [
    Option("mode", Mapped({GRAPH_MODE: "GRAPH_MODE", PYNATIVE_MODE: "PYNATIVE_MODE"}), PYNATIVE_MODE,
           "Execution mode: GRAPH_MODE makes obs.compile() use torch.compile with the obs backend; PYNATIVE is eager.",
           effect="obs.compile → torch.compile"),
    Option("device_target", Choice(("CPU", "GPU", "Ascend", "Davinci")), "CPU",
           "Device obs.device() returns: CPU, GPU (cuda:N) or Ascend (npu:N, needs a torch NPU backend).",
           effect="obs.device(), torch.cuda.set_device"),
    Option("device_id", Int(min=0, max=4095), 0, "Index of the device of device_target.",
           effect="obs.device(), torch.cuda.set_device"),
    Option("max_device_memory", Size(), 1024.0, "Most device memory this process may use, like '3.5GB'.",
           devices=GPU_ASCEND, effect="torch.cuda.set_per_process_memory_fraction"),
    Option("variable_memory_max_size", Size(max_gb=31), 0.0, "Old cap of variable memory (Ascend).",
           devices=ASCEND, deprecated="use 'max_device_memory' instead"),
    Option("mempool_block_size", Size(min_gb=1.0), 1.0, "Block size of the device memory pool, at least '1GB'.",
           devices=GPU_ASCEND),
    Option("op_timeout", Int(min=0), 900,
           "Seconds without progress of a step, op or collective before it counts as a hang (0 = never)."),
    Option("save_graphs", SaveGraphsLevel(), 0, "Graph/IR dump level 0-3 for graphs compiled by obs.compile "
           "(True = 2, False = 0)."),
    Option("save_graphs_path", Str(non_empty=True), ".", "Folder of graph/IR dumps."),
    Option("enable_dump", Bool(), False, "Old switch of the data dump (1.x)."),
    Option("save_dump_path", Str(non_empty=True), ".", "Old folder of the data dump (1.x)."),
    Option("deterministic", Choice(("ON", "OFF")), "OFF", "'ON' makes ops use deterministic algorithms.",
           effect="torch.use_deterministic_algorithms, cudnn.deterministic"),
    Option("print_file_path", Str(non_empty=True), "", "File that obs.Print appends print.pb records to; "
           "unset prints to the screen."),
    Option("env_config_path", ExistingFile(), "", "JSON file of the rdr/sys sections, hot-reloaded when it changes."),
    Option("precompile_only", Bool(), False, "Only compile graphs, do not run them.",
           deprecated="MindSpore moved it to env MS_DEV_PRECOMPILE_ONLY; " + _NO_EFFECT),
    Option("reserve_class_name_in_scope", Bool(), True,
           "Keep class names in scope names (Default/net-Net/fc1-Linear vs Default/net/fc1)."),
    Option("pynative_synchronize", Bool(), False, "Run device work synchronously so an error points at its line.",
           effect="CUDA_LAUNCH_BLOCKING"),
    Option("debug_level", Mapped({RELEASE: "RELEASE", DEBUG: "DEBUG"}), RELEASE, "RELEASE or DEBUG diagnostics."),
    Option("enable_graph_kernel", Bool(), False, "Graph-kernel fusion."),
    Option("graph_kernel_flags", Str(), "", "Flags of graph-kernel fusion, e.g. '--opt_level=2'."),
    Option("enable_reduce_precision", Bool(), True, "Allow reduced precision when an op lacks a dtype (Ascend).",
           devices=ASCEND),
    Option("aoe_tune_mode", Choice(("online", "offline")), "", "AOE tuning mode (Ascend).", devices=ASCEND),
    Option("aoe_config", Dict(schema={"job_type": Choice(("1", "2"))}), {}, "AOE options (Ascend).",
           devices=ASCEND),
    Option("check_bprop", Bool(), False, "Check custom bprop outputs.", deprecated=_NO_EFFECT),
    Option("max_call_depth", Int(min=1), 1000, "Maximum depth of nested graph calls."),
    Option("grad_for_scalar", Bool(), False, "Take gradients of scalar inputs.", deprecated=_NO_EFFECT),
    Option("enable_compile_cache", Bool(), None, "Cache compiled graphs across runs."),
    Option("compile_cache_path", Str(non_empty=True), "", "Folder of the compile cache."),
    Option("inter_op_parallel_num", Int(min=0), 0, "Threads running independent ops in parallel (0 = framework "
           "default).", effect="torch.set_num_interop_threads"),
    Option("runtime_num_threads", Int(min=0), 0, "Threads of CPU kernels (0 = framework default).",
           effect="torch.set_num_threads"),
    Option("disable_format_transform", Bool(), False, "Disable NCHW→NHWC transforms (GPU).", devices=GPU),
    Option("support_binary", Bool(), False, "Run graph-mode code from .pyc files."),
    Option("memory_optimize_level", Choice(("O0", "O1")), "O0", "Memory optimisation level."),
    Option("memory_offload", Choice(("ON", "OFF")), "OFF", "Offload device memory to the host.",
           devices=GPU_ASCEND),
    Option("ascend_config", _ASCEND_CONFIG, {}, "Ascend options; its 'exception_dump' ('0' off, '1' inputs and "
           "outputs, '2' lite) applies on every device."),
    Option("jit_syntax_level", Mapped({STRICT: "STRICT", COMPATIBLE: "COMPATIBLE", LAX: "LAX"}), LAX,
           "How much Python graph mode accepts."),
    Option("gpu_config", _GPU_CONFIG, {}, "cuDNN algorithm choice and TF32 switches (GPU).", devices=GPU,
           effect="torch.backends.cudnn.benchmark / allow_tf32, cuda.matmul.allow_tf32"),
    Option("save_ms_model", Bool(), False, "Export a MindSpore Lite model.",
           deprecated="use torch.export; " + _NO_EFFECT),
    Option("save_ms_model_path", Str(non_empty=True), "./model.ms", "Path of the exported model.",
           deprecated="use torch.export; " + _NO_EFFECT),
    Option("enable_auto_mixed_precision", Bool(), False, "Automatic mixed precision.",
           deprecated="use torch.autocast; " + _NO_EFFECT),
    Option("enable_profiling", Bool(), False, "Turn the profiler on: spans of steps and their phases (and modules, "
           "ops) to OTLP or local trace files, built outside the training process.", effect="exporter process"),
    Option("profiling_options", ProfilingOptions(), "training_trace", "Profiler levels joined by ':' "
           "(training_trace, task_trace, op_trace) or JSON text {\"output\": \"/abs/dir\", \"task_trace\": \"on\"}."),
    Option("auto_tune_mode", Choice(("NO_TUNE", "RL", "GA", "RL,GA", "GA,RL")), "NO_TUNE", "Old auto-tuning mode.",
           deprecated="use 'aoe_tune_mode' instead"),
    Option("enable_sparse", Bool(), False, "Sparse tensors.", deprecated=_NO_EFFECT),
], moved={key: "ascend_config" for key in _ASCEND_CONFIG.schema} | {"conv_fprop_algo": "gpu_config",
          "conv_dgrad_algo": "gpu_config", "conv_wgrad_algo": "gpu_config", "conv_allow_tf32": "gpu_config",
          "matmul_allow_tf32": "gpu_config"})

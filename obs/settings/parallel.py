"""``set_auto_parallel_context`` and ``set_ps_context``: MindSpore's keys and defaults; rank and world size.

``global_rank`` / ``device_num`` name the ``rank_{id}`` folders of every dump; once
torch.distributed is initialised its rank and world size win.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from obs._core import env
from obs.settings._table import Option, OptionTable
from obs.settings._validators import Bool, Choice, Int, Str, Validator, fail, type_fail

__all__ = ["AUTO_PARALLEL_OPTIONS", "PS_OPTIONS", "ParallelMode", "distributed", "get_auto_parallel_context",
           "get_ps_context", "rank", "rank_given", "reset_auto_parallel_context", "reset_ps_context",
           "set_auto_parallel_context", "set_ps_context", "world_size"]


class ParallelMode:
    """The values of ``parallel_mode``."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODE_LIST = (STAND_ALONE, DATA_PARALLEL, HYBRID_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL)


_SEARCH = ("recursive_programming", "dynamic_programming", "sharding_propagation")


@dataclass(frozen=True)
class IntList(Validator):
    def __call__(self, value: Any, name: str) -> list[int]:
        if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise type_fail(name, "a list of ints", value)
        if any(v <= 0 for v in value):
            raise fail(name, "a list of positive ints", value)
        return list(value)

    def describe(self) -> str:
        return "list[int]"


@dataclass(frozen=True)
class DatasetStrategy(Validator):
    def __call__(self, value: Any, name: str) -> Any:
        if isinstance(value, str):
            return Choice(("data_parallel", "full_batch"))(value, name)
        if isinstance(value, tuple) and all(isinstance(t, tuple) and all(isinstance(i, int) and not isinstance(
                i, bool) and i > 0 for i in t) for t in value):
            return value
        raise type_fail(name, "'data_parallel', 'full_batch' or a tuple of tuples of positive ints", value)

    def describe(self) -> str:
        return "str | tuple[tuple[int]]"


@dataclass(frozen=True)
class CommFusion(Validator):
    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise type_fail(name, "a dict with keys openstate, allreduce, allgather, reducescatter", value)
        out: dict[str, Any] = {}
        for key, sub in value.items():
            if key == "openstate":
                out[key] = Bool()(sub, f"{name}.openstate")
            elif key in ("allreduce", "allgather", "reducescatter"):
                if not isinstance(sub, dict) or set(sub) - {"mode", "config"}:
                    raise fail(f"{name}.{key}", "a dict with keys 'mode' and 'config'", sub)
                mode = Choice(("auto", "size", "index"))(sub.get("mode", "auto"), f"{name}.{key}.mode")
                out[key] = {"mode": mode, "config": sub.get("config")}
            else:
                raise fail(name, "a dict with keys openstate, allreduce, allgather, reducescatter", value)
        return out

    def describe(self) -> str:
        return "dict: openstate, allreduce, allgather, reducescatter"


@dataclass(frozen=True)
class StrategyCkptConfig(Validator):
    def __call__(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise type_fail(name, "a dict with keys load_file, save_file, only_trainable_params", value)
        checks = {"load_file": Str(), "save_file": Str(), "only_trainable_params": Bool()}
        out = {}
        for key, sub in value.items():
            if key not in checks:
                raise fail(name, f"a dict with keys {sorted(checks)}", value)
            out[key] = checks[key](sub, f"{name}.{key}")
        return {"load_file": "", "save_file": "", "only_trainable_params": True, **out}

    def describe(self) -> str:
        return "dict: load_file, save_file, only_trainable_params"


@dataclass(frozen=True)
class WeightShardSize(Validator):
    def __call__(self, value: Any, name: str) -> int:
        value = Int()(value, name)
        if value != -1 and value <= 0:
            raise fail(name, "-1 or a positive int", value)
        return value

    def describe(self) -> str:
        return "int (-1 or > 0)"


_FUSION_DEFAULT = {"openstate": True, "allreduce": {"mode": "auto", "config": None},
                   "allgather": {"mode": "auto", "config": None}, "reducescatter": {"mode": "auto", "config": None}}

AUTO_PARALLEL_OPTIONS = OptionTable("set_auto_parallel_context", [
    Option("device_num", Int(min=1), 1, "Number of devices (world size) when torch.distributed is not initialised."),
    Option("global_rank", Int(min=0, max=4095), 0, "Rank of this process when torch.distributed is not "
           "initialised; names the rank_{id} folders."),
    Option("gradients_mean", Bool(), False, "Average gradients after all-reduce."),
    Option("gradient_fp32_sync", Bool(), True, "All-reduce gradients in float32."),
    Option("parallel_mode", Choice(ParallelMode.MODE_LIST), ParallelMode.STAND_ALONE, "Parallel mode."),
    Option("search_mode", Choice(_SEARCH), "recursive_programming", "Strategy search of auto_parallel."),
    Option("auto_parallel_search_mode", Choice(_SEARCH), "recursive_programming", "Old name of search_mode.",
           deprecated="use 'search_mode' instead"),
    Option("parameter_broadcast", Bool(), False, "Broadcast parameters before training."),
    Option("strategy_ckpt_load_file", Str(), "", "Strategy checkpoint to load."),
    Option("strategy_ckpt_save_file", Str(), "", "Strategy checkpoint to save."),
    Option("full_batch", Bool(), False, "Every rank loads the whole batch."),
    Option("dataset_strategy", DatasetStrategy(), "data_parallel", "How datasets are split across ranks."),
    Option("enable_parallel_optimizer", Bool(), False, "Shard optimizer state."),
    Option("force_fp32_communication", Bool(), False, "Communicate in float32."),
    Option("enable_alltoall", Bool(), False, "Allow AllToAll."),
    Option("pipeline_stages", Int(min=1), 1, "Pipeline stages."),
    Option("pipeline_result_broadcast", Bool(), False, "Broadcast pipeline results."),
    Option("auto_pipeline", Bool(), False, "Choose pipeline stages automatically."),
    Option("dump_local_norm", Bool(), False, "Dump local gradient norms."),
    Option("dump_local_norm_path", Str(), "", "Folder of local norm dumps."),
    Option("dump_device_local_norm", Bool(), False, "Dump device-local norms."),
    Option("all_reduce_fusion_config", IntList(), [], "Split points of all-reduce fusion."),
    Option("comm_fusion", CommFusion(), _FUSION_DEFAULT, "Communication fusion per collective."),
    Option("strategy_ckpt_config", StrategyCkptConfig(),
           {"load_file": "", "save_file": "", "only_trainable_params": True}, "Strategy checkpoint options."),
    Option("grad_accumulation_step", Int(min=1), 1, "Gradient accumulation steps."),
    Option("sharding_propagation", Bool(), False, "Propagate sharding strategies."),
    Option("optimizer_weight_shard_size", WeightShardSize(), -1, "Optimizer weight shard group size."),
])

PS_OPTIONS = OptionTable("set_ps_context", [
    Option("server_mode", Str(), "", "Parameter-server mode."),
    Option("ms_role", Choice(("MS_WORKER", "MS_PSERVER", "MS_SCHED", "MS_NOT_PS")), "MS_NOT_PS", "Role."),
    Option("enable_ps", Bool(), False, "Enable the parameter server."),
    Option("worker_num", Int(min=0), 0, "Number of workers."),
    Option("server_num", Int(min=0), 0, "Number of servers."),
    Option("scheduler_ip", Str(non_empty=True), "127.0.0.1", "Scheduler address."),
    Option("scheduler_port", Int(min=1, max=65535), 6667, "Scheduler port."),
    Option("enable_ssl", Bool(), False, "Use SSL between roles."),
    Option("client_password", Str(), "", "Client certificate password (write-only)."),
    Option("server_password", Str(), "", "Server certificate password (write-only)."),
    Option("config_file_path", Str(), "", "Recovery config file."),
])
_WRITE_ONLY = frozenset({"client_password", "server_password"})


class _Store:
    """One frozen mapping per table, swapped whole after a call validated."""

    def __init__(self, table: OptionTable) -> None:
        self.table = table
        self.values: Mapping[str, Any] = MappingProxyType({})
        self.lock = threading.Lock()

    def set(self, kwargs: Mapping[str, Any]) -> tuple[tuple[str, type[Warning]], ...]:
        with self.lock:
            checked = self.table.validate(kwargs, source=self.table.title)
            new = {**self.values, **checked.values}
            for key in checked.unset:
                new.pop(key, None)
            self.values = MappingProxyType(new)
        return checked.warnings

    def get(self, key: str, source: str) -> Any:
        if key not in self.table:
            raise self.table.unknown(key, source)
        value = self.values.get(key, self.table[key].default)
        return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value


_auto = _Store(AUTO_PARALLEL_OPTIONS)
_ps = _Store(PS_OPTIONS)


def _warn(notes: tuple[tuple[str, type[Warning]], ...]) -> None:
    import warnings

    for message, category in notes:
        warnings.warn(message, category, stacklevel=3)


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set parallel keys (all validated before any is applied)."""
    _warn(_auto.set(kwargs))


def get_auto_parallel_context(key: str) -> Any:
    return _auto.get(key, "get_auto_parallel_context")


def reset_auto_parallel_context() -> None:
    _auto.values = MappingProxyType({})


def set_ps_context(**kwargs: Any) -> None:
    """Set parameter-server keys (all validated before any is applied)."""
    _warn(_ps.set(kwargs))


def get_ps_context(key: str) -> Any:
    if key in _WRITE_ONLY:
        from obs._core.errors import ObsConfigError

        raise ObsConfigError(f"get_ps_context: {key!r} is write-only", option=key)
    return _ps.get(key, "get_ps_context")


def reset_ps_context() -> None:
    """Every PS key back to its default (enable_ssl included)."""
    _ps.values = MappingProxyType({})


def distributed() -> Any:
    """torch.distributed once this process has initialised it, else None (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def rank() -> int:
    """This process's rank: torch.distributed, else ``global_rank`` when set, else ``$RANK``, else 0."""
    dist = distributed()
    if dist is not None:
        return int(dist.get_rank())
    if "global_rank" in _auto.values:
        return int(_auto.values["global_rank"])
    return env.integer(env.RANK, 0)


def world_size() -> int:
    """Number of ranks: torch.distributed, else ``device_num`` when set, else ``$WORLD_SIZE``, else 1."""
    dist = distributed()
    if dist is not None:
        return int(dist.get_world_size())
    if "device_num" in _auto.values:
        return int(_auto.values["device_num"])
    return env.integer(env.WORLD_SIZE, 1)


def rank_given() -> bool:
    """Whether :func:`rank` is this process's before ``init_process_group``: torch.distributed is up,
    ``global_rank`` or ``$RANK`` says it, or nothing says there are other ranks (no ``$WORLD_SIZE`` above 1, no
    ``$LOCAL_RANK``, no multiprocessing parent: a plain process is rank 0 of 1).  Else the rank is unknown until
    ``init_process_group``: launchers that start their ranks without ``RANK`` (Lightning's, by ``subprocess`` with
    ``LOCAL_RANK`` and ``WORLD_SIZE``; ``torch.multiprocessing.spawn``)."""
    if distributed() is not None or "global_rank" in _auto.values or env.text(env.RANK):
        return True
    if env.text(env.LOCAL_RANK) or env.integer(env.WORLD_SIZE, 1) > 1:
        return False
    import multiprocessing

    return multiprocessing.parent_process() is None

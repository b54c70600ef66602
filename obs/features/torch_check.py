"""The first ``set_context`` refuses a torch obs does not support, before anything is applied: a clear error
naming the version and the range, instead of a failure deep inside torch later (:mod:`obs.runtime.torch_support`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from obs.runtime.torch_support import check

__all__ = ["TorchCheck", "feature"]


class TorchCheck:
    """An applier with no keys that takes part in the first call only, and checks there."""

    keys: frozenset[str] = frozenset()
    on_first_call = True

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        check()

    def commit(self, prepared: None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


feature = TorchCheck()

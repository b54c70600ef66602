"""Names for the monitor: the model of an optimizer's parameters, found among its callers' frames, or the first module
called (the discovery hook, and the one warning of torch's it would cause), and msprobe's rule of which parameters and
modules the ``targets`` watch."""

from __future__ import annotations

import fnmatch
import sys
import types
import warnings
from typing import Any

import torch

__all__ = ["clean", "find_model", "hush_compile_hook_warning", "matches", "unhush"]


def find_model(params: list[torch.Tensor], depth: int = 1) -> torch.nn.Module | None:
    """The model of an optimizer's parameters, from the frames that called ``optimizer.step()`` (their locals and
    globals, and one level of attributes: ``self.model``): the module holding most of them, the largest on a tie.
    No global module hook, so ``torch.compile`` sees none (it warns when there is one).  ``depth``: frames to skip
    (the caller's own is 1)."""
    want = {id(p) for p in params}
    best: tuple[int, int, Any] = (0, 0, None)
    seen: set[int] = set()
    frame = sys._getframe(depth)
    for _ in range(40):
        if frame is None:
            break
        for scope in (frame.f_locals, frame.f_globals):
            for value in list(scope.values()):
                for module in _modules_in(value):
                    if id(module) in seen:
                        continue
                    seen.add(id(module))
                    mine = [id(p) for p in module.parameters()]
                    got = (sum(1 for i in mine if i in want), len(mine), module)
                    if got[:2] > best[:2]:
                        best = got
        frame = frame.f_back
    return best[2]


def _modules_in(value: Any) -> list[torch.nn.Module]:
    """A module, or the modules among an object's attributes (a trainer's ``self.model``)."""
    if isinstance(value, torch.nn.Module):
        return [value]
    if isinstance(value, (type, types.ModuleType)) or not hasattr(value, "__dict__"):
        return []  # a Python module's names are no trainer's (torch.distributed's warn when touched)
    try:
        attrs = vars(value)
    except TypeError:
        return []
    return [v for v in attrs.values() if isinstance(v, torch.nn.Module)]


def clean(name: str) -> str:
    """A name without torch.compile's wrapper (``_orig_mod.``)."""
    return name.replace("_orig_mod.", "")


def matches(name: str, targets: tuple[str, ...], *, modules: bool = False) -> bool:
    """msprobe's rule: a parameter is watched when its name starts with a target; a module when its name is a target.
    obs also takes shell patterns (``h.*.mlp``) for both."""
    for target in targets:
        if modules:
            if name == target or (any(c in target for c in "*?[") and fnmatch.fnmatchcase(name, target)):
                return True
        elif name.startswith(target) or (any(c in target for c in "*?[") and fnmatch.fnmatchcase(name, target + "*")):
            return True
    return False


#: torch warns at every call of a ``torch.compile``d module while a global module hook is installed
_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def hush_compile_hook_warning() -> Any:
    """Ignore torch's warning about global module hooks while the monitor's discovery hook is installed: that hook
    removes itself in the first call, before Dynamo traces anything, so it never fires an extra time.  Returns the
    filter, for :func:`unhush`."""
    warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
    return warnings.filters[0]


def unhush(entry: Any) -> None:
    """Take the filter of :func:`hush_compile_hook_warning` out again."""
    try:
        warnings.filters.remove(entry)
    except ValueError:
        return
    mutated = getattr(warnings, "_filters_mutated", None)  # the module's cache of filters, where it has one
    if mutated is not None:
        mutated()

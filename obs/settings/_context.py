"""``set_context`` / ``get_context`` / ``reset_context``: validate a whole call, swap one frozen snapshot.

Side effects live in *appliers* (env config + hot reload, the PyTorch runtime, later the print
sink...).  A call is validated completely, then every applier *prepares* (may raise, no side
effects), then the snapshot is swapped and every applier *commits*.  A commit that fails is rolled
back with the earlier ones (each is committed again with the old values), so a failing call
changes nothing.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from obs._core.events import Event, bus
from obs._core.internal import report_internal_error
from obs.settings._table import canonical_device
from obs.settings._validators import Dict
from obs.settings.context_options import CONTEXT_OPTIONS

__all__ = ["Applier", "get_context", "register_applier", "reset_context", "set_context", "snapshot"]

Changes = Mapping[str, tuple[Any, Any]]


class Applier(Protocol):
    """Turns settings into effects.  ``keys``: what it reacts to.  ``close``: undo everything.

    An applier with a true ``on_first_call`` attribute also takes part in the first ``set_context`` call
    (the first after ``reset_context``), whatever its keys and even when the call changes nothing: that
    is where MindSpore reads its environment variables (``MINDSPORE_DUMP_CONFIG``)."""

    keys: frozenset[str]

    def prepare(self, values: Mapping[str, Any], changes: Changes) -> Any: ...

    def commit(self, prepared: Any, values: Mapping[str, Any], changes: Changes) -> None: ...

    def close(self) -> None: ...


_lock = threading.RLock()
_values: Mapping[str, Any] = MappingProxyType({})
_appliers: list[Applier] = []
_called = False  # a set_context call has succeeded since the start (or the last reset_context)


def register_applier(applier: Applier) -> None:
    """Add an applier (at import time of the feature that owns it)."""
    _appliers.append(applier)


def snapshot() -> Mapping[str, Any]:
    """The frozen mapping of explicitly set keys currently in force."""
    return _values


def _effective(values: Mapping[str, Any], key: str) -> Any:
    return values.get(key, CONTEXT_OPTIONS[key].default)


def set_context(**kwargs: Any) -> None:
    """Set any number of context keys at once; all are validated before any is applied.

    ``None`` as a value sets a key back to its default.  Unknown keys raise ValueError with close
    matches; wrong types TypeError; bad values ValueError naming key, expectation and value.
    Deprecated keys give a DeprecationWarning naming the replacement; keys for another device
    than ``device_target`` are ignored with a warning.
    """
    if not kwargs and _called:
        return
    with _lock:
        old = _values
        target = kwargs.get("device_target") or _effective(old, "device_target")
        device = canonical_device(target) if isinstance(target, str) else None
        checked = CONTEXT_OPTIONS.validate(kwargs, source="set_context", device=device)
        new = dict(old)
        for key, value in checked.values.items():
            if isinstance(CONTEXT_OPTIONS[key].check, Dict):
                value = {**old.get(key, {}), **value}
            new[key] = value
        for key in checked.unset:
            new.pop(key, None)
        _swap(old, new, "set_context")
    for message, category in checked.warnings:
        warnings.warn(message, category, stacklevel=2)


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    out = {}
    for key in set(old) | set(new):
        before, after = _effective(old, key), _effective(new, key)
        if before != after or type(before) is not type(after):
            out[key] = (before, after)
    return out


def _swap(old: Mapping[str, Any], new: dict[str, Any], source: str) -> None:
    global _values, _called
    changes = _changes(old, new)
    first = not _called  # only set_context swaps here; reset_context clears the flag
    if not changes and not first:
        _values = MappingProxyType(new)
        return
    frozen = MappingProxyType(new)
    involved = [a for a in _appliers if a.keys & changes.keys() or (first and getattr(a, "on_first_call", False))]
    prepared = [a.prepare(frozen, changes) for a in involved]
    touched: list[Applier] = []
    _values = frozen
    try:
        for applier, token in zip(involved, prepared):
            touched.append(applier)  # before commit: a commit that fails half-way is rolled back too
            applier.commit(token, frozen, changes)
    except BaseException:
        _values = old
        back = {k: (b, a) for k, (a, b) in changes.items()}
        for applier in reversed(touched):
            try:
                applier.commit(applier.prepare(old, back), old, back)
            except Exception as exc:  # noqa: BLE001 - the original failure is the one the caller must see
                report_internal_error(f"settings rollback of {type(applier).__name__}", exc)
        raise
    if first:
        _called = True
    if changes:
        bus.emit(Event.SETTINGS_CHANGED, source, changes)


def get_context(key: str) -> Any:
    """The value in force for ``key`` (its default when never set); dict options return a copy."""
    if key not in CONTEXT_OPTIONS:
        raise CONTEXT_OPTIONS.unknown(key, "get_context")
    value = _effective(_values, key)
    return dict(value) if isinstance(value, dict) else value


def reset_context() -> None:
    """Every key back to its default; every feature off, its files closed, hooks and watchers gone."""
    global _values, _called
    with _lock:
        old = _values
        changes = _changes(old, {})
        for applier in reversed(_appliers):
            applier.close()
        _values = MappingProxyType({})
        _called = False
    if changes:
        bus.emit(Event.SETTINGS_CHANGED, "reset", changes)

"""One registry of hooks: add, remove and call, copy-on-write, with removable handles.

Calling (:meth:`Hooks.call`) iterates :attr:`Hooks.snapshot`, an immutable tuple that adding or
removing replaces under a lock: the hot path takes no lock, it is one attribute load and a tuple loop, and
a hook added or removed while the hooks run counts from the next call.  :meth:`Hooks.add` returns a
:class:`HookHandle` (pluggy's and ``torch.utils.hooks``' habit): ``remove()`` is idempotent, and ``with``
removes on exit; an owner that keeps no handle removes its hook by value (:meth:`Hooks.remove`, idempotent
too).

Hooks run in the order they were added.  A failing hook never reaches the caller (a user's training loop):
its error goes to :func:`~obs._core.internal.report_internal_error` (counted, logged once per hook, raised
in the test suite), and the next hook still runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from obs._core.internal import report_internal_error

__all__ = ["HookHandle", "Hooks"]

T = TypeVar("T")
H = TypeVar("H", bound="HookHandle[Any]")


class HookHandle(Generic[T]):
    """One hook of a :class:`Hooks`; ``remove()`` is idempotent, ``with`` removes on exit."""

    __slots__ = ("hook", "_owner", "__weakref__")

    def __init__(self, owner: Hooks[T], hook: T) -> None:
        self.hook = hook
        # Weak: a handle kept by its owner's owner does not keep a dropped registry alive.
        self._owner: weakref.ref[Hooks[T]] | None = weakref.ref(owner)

    @property
    def active(self) -> bool:
        """Whether the hook is still in its registry."""
        return self._owner is not None

    def remove(self) -> None:
        ref, self._owner = self._owner, None
        owner = ref() if ref is not None else None
        if owner is not None:
            owner._drop(self)

    def __enter__(self: H) -> H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Hooks(Generic[T]):
    """The hooks of one extension point, called in the order they were added.

    ``name`` names them in error reports (``"{name} {hook's qualified name}"``); ``on_change()`` is called after
    each add or remove, outside the lock (the bus tells the adapters which events gained or lost subscribers).
    """

    __slots__ = ("name", "snapshot", "_handles", "_lock", "_on_change", "__weakref__")

    def __init__(self, name: str, on_change: Callable[[], None] | None = None) -> None:
        self.name = name
        #: The hooks now, in order: a tuple replaced (never changed) by every add and remove.
        self.snapshot: tuple[T, ...] = ()
        self._handles: tuple[HookHandle[T], ...] = ()
        self._lock = threading.Lock()
        self._on_change = on_change

    def add(self, hook: T) -> HookHandle[T]:
        """Call ``hook`` from now on, after the hooks already added; the handle removes it."""
        return self.attach(HookHandle(self, hook))

    def attach(self, handle: H) -> H:
        """Add a handle made for this registry: a :class:`HookHandle` subclass that carries more (the bus's
        ``Subscription`` its event, the step tracker's ``StepDemand`` its reason)."""
        owner = handle._owner() if handle._owner is not None else None
        if owner is not self:
            raise ValueError(f"attach: the handle of {handle.hook!r} was made for another registry than "
                             f"{self.name!r}, or was removed already")
        with self._lock:
            self._replace(self._handles + (handle,))
        self._changed()
        return handle

    def remove(self, hook: object) -> None:
        """Remove ``hook`` (as often as it was added; nothing where it is not here); its handles become inactive."""
        self._take(lambda h: h.hook == hook)

    def clear(self) -> None:
        """Remove every hook; their handles become inactive."""
        self._take(lambda h: True)

    def _drop(self, handle: HookHandle[T]) -> None:
        self._take(lambda h: h is handle)

    def _take(self, leaving: Callable[[HookHandle[T]], bool]) -> None:
        with self._lock:
            gone = tuple(h for h in self._handles if leaving(h))
            if not gone:
                return
            self._replace(tuple(h for h in self._handles if h not in gone))
        for handle in gone:
            handle._owner = None
        self._changed()

    def _replace(self, handles: tuple[HookHandle[T], ...]) -> None:
        self._handles = handles
        self.snapshot = tuple(h.hook for h in handles)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def call(self: Hooks[Callable[..., Any]], *args: Any) -> None:
        """Call each hook with ``args``; a failing one is reported, and the next one still runs."""
        for hook in self.snapshot:
            try:
                hook(*args)
            except Exception as exc:  # noqa: BLE001 - reported; a hook's bug must not break the training loop
                report_internal_error(f"{self.name} {getattr(hook, '__qualname__', hook)}", exc)

    def __len__(self) -> int:
        return len(self.snapshot)

    def __iter__(self) -> Iterator[T]:
        return iter(self.snapshot)

    def __contains__(self, hook: object) -> bool:
        return hook in self.snapshot

    def __repr__(self) -> str:
        return f"Hooks({self.name!r}, {len(self.snapshot)} hook(s))"

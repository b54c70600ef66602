"""Wrappers of ``torch.autograd.backward`` / ``grad``: callbacks before backward starts, when it ends, when it raises.

The one way obs wraps them: the PHASE events (backward time), exception_dump (the error) and the NaN/Inf
check (settling before backward) each hold their own :class:`AutogradCall`.

``loss.backward()`` goes through ``torch.autograd.backward``, so these two functions see every backward a user
starts.  A wrapper leaves no frame in the user's traceback, and unwrapping leaves a later wrapper in place
(this one is inert then).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from obs._core.internal import SUPPRESSION, leave_traceback, report_internal_error

__all__ = ["AutogradCall", "roots_of"]


def roots_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensors a ``backward``/``grad`` call differentiates (a tensor or a sequence of them)."""
    return args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))


class AutogradCall:
    """``owner.name`` wrapped: ``on_start(roots)`` before the call, ``on_error(error, roots)`` when it raises,
    ``on_end(started)`` after it returns or raises, with what ``on_start`` returned.  Or, alone, ``on_span(begin_ns,
    end_ns)`` after it returns or raises, with ``time.perf_counter_ns()`` before and after: a lighter wrapper, for
    timing (the backward phase).

    None runs inside obs's own work (``SUPPRESSION``); an error of any is reported, never raised."""

    def __init__(self, owner: Any, name: str, *, on_start: Any = None, on_error: Any = None,
                 on_end: Any = None, on_span: Any = None) -> None:
        if on_span is not None and (on_start is not None or on_error is not None or on_end is not None):
            raise TypeError("on_span times the call alone: give it without on_start, on_error and on_end")
        self.owner, self.name, self.active = owner, name, True
        original = self.original = getattr(owner, name)
        me, getframe, state = self, sys._getframe, SUPPRESSION

        def obs_autograd_call(*args: Any, **kwargs: Any) -> Any:
            watched = me.active and not state.depth
            started = None
            if on_start is not None and watched:
                try:
                    started = on_start(roots_of(args, kwargs))
                except Exception as inner:  # noqa: BLE001 - reported; a hook's bug must not break backward
                    report_internal_error(f"autograd {name} start", inner)
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                leave_traceback(exc, getframe())  # this wrapper leaves the user's traceback
                if on_error is not None and me.active and not state.depth:
                    try:
                        on_error(exc, roots_of(args, kwargs))
                    except Exception as inner:  # noqa: BLE001 - reported; a hook's bug must not break backward
                        report_internal_error(f"autograd {name} error", inner)
                raise
            finally:
                if on_end is not None and watched:
                    try:
                        on_end(started)
                    except Exception as inner:  # noqa: BLE001 - reported; a hook's bug must not break backward
                        report_internal_error(f"autograd {name} end", inner)

        def obs_autograd_timed(*args: Any, **kwargs: Any) -> Any:
            begin = clock() if me.active and not state.depth else 0
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                leave_traceback(exc, getframe())  # this wrapper leaves the user's traceback
                raise
            finally:
                if begin:
                    try:
                        on_span(begin, clock())
                    except Exception as inner:  # noqa: BLE001 - reported; a hook's bug must not break backward
                        report_internal_error(f"autograd {name} span", inner)

        clock = time.perf_counter_ns
        self.wrapper = obs_autograd_timed if on_span is not None else obs_autograd_call
        setattr(owner, name, self.wrapper)

    def unwrap(self) -> None:
        self.active = False
        if getattr(self.owner, self.name) is self.wrapper:
            setattr(self.owner, self.name, self.original)

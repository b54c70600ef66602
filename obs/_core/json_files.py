"""Read obs's own JSON files: one reader with a size limit, and errors that name the file, what was expected and
what was found.

Every reader of a JSON file obs wrote (a bundle's manifest, a rank's marker, a request, an exporter's status, a
graph index) goes through :func:`read_json`; JSON found inside a larger file (a line of ``events.jsonl``) through
:func:`parse_json`.  The errors:

* ``OSError`` as the file system gives it (absent, unreadable), :class:`~obs._core.errors.UnsafePathError` (an
  ``OSError`` too) for a symlink, a file that is not regular or (``owned``) another user's;
* :class:`~obs._core.errors.NotOurFileError` for a file obs never writes: larger than its limit, or JSON of
  another shape than expected (an array where obs writes an object);
* :class:`~obs._core.errors.DamagedFileError` for a torn or corrupt one: not UTF-8, not JSON, with the byte offset.

Both of the last are ``ValueError``: a caller that only skips what it cannot read catches ``(OSError, ValueError)``.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeGuard

from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError, shorten

__all__ = ["DEFAULT_LIMIT", "is_int", "parse_json", "read_json"]

DEFAULT_LIMIT = 1 << 24  #: bytes: more than any JSON file obs writes (a bundle's stacks, an exporter's status)

_NAMES: dict[type, str] = {dict: "a JSON object", list: "a JSON array"}


def read_json(path: str, *, what: str, limit: int = DEFAULT_LIMIT, expect: type | None = dict,
              owned: bool = True) -> Any:
    """The JSON value in ``path``, one of obs's own files: ``what`` names it in errors, with its article (``"a
    request"``, ``"the demo's marker"``).

    Opened with :func:`~obs._core.safe_files.open_private` (``owned``: only a file of this user); at most ``limit``
    bytes are read, and a larger file is refused unread.  ``expect``: the type of the top-level value (None: any).
    The errors are the module's."""
    fd = safe_files.open_private(path, owned=owned)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
        if len(data) > limit:
            raise NotOurFileError(f"{path}: {os.fstat(fh.fileno()).st_size} bytes, more than {what} ever holds "
                                  f"({limit} bytes); not read", path=path)
    value = parse_json(data, path)
    if expect is not None and not isinstance(value, expect):
        found = _NAMES.get(type(value), f"a JSON {type(value).__name__}")
        raise NotOurFileError(f"{path}: not {what}: expected {_NAMES.get(expect, expect.__name__)}, found {found} "
                              f"{shorten(value, 60)}", path=path)
    return value


def parse_json(data: bytes, path: str, *, base: int = 0) -> Any:
    """``data`` (found at byte ``base`` of ``path``) as JSON; a :class:`DamagedFileError` with the byte offset and
    what stands there when it is not JSON."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"{path}: not UTF-8 at byte {base + exc.start} (found "
                               f"{bytes(data[exc.start:exc.start + 8])!r})", path=path,
                               offset=base + exc.start) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = base + len(text[:exc.pos].encode("utf-8"))
        found = repr(text[exc.pos:exc.pos + 20]) if exc.pos < len(text) else "the end"
        raise DamagedFileError(f"{path}: not valid JSON at byte {at} ({exc.msg}; found {found})", path=path,
                               offset=at) from None
    except (ValueError, RecursionError) as exc:  # nesting too deep, an integer too long
        raise DamagedFileError(f"{path}: unreadable JSON at byte {base} ({type(exc).__name__}: "
                               f"{str(exc)[:80] or 'nested too deeply'})", path=path, offset=base) from None


def is_int(value: Any) -> TypeGuard[int]:
    """``value`` is a JSON integer (an ``int``, and not a ``bool``, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)

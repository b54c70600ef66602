"""The declarative option row and table: one place drives validation, defaults, docs and `obs options`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from obs._core.errors import ObsConfigError
from obs.settings._validators import Dict, Validator, did_you_mean

__all__ = ["Option", "OptionTable", "Validated", "canonical_device"]

def canonical_device(target: str) -> str:
    """``Davinci`` is MindSpore's old name of ``Ascend``."""
    return "Ascend" if target == "Davinci" else target


@dataclass(frozen=True)
class Option:
    """One option: its validator, default, meaning and where it applies.

    ``devices`` None means every device.  ``deprecated`` is the advice given with the
    DeprecationWarning (the replacement, or why there is none).  ``effect`` says what setting it
    does in PyTorch ("" = validated, stored and reported only).  ``required``: a config file must
    give it (the dump config's fields; set_context's keys all have defaults).
    """

    name: str
    check: Validator
    default: Any
    doc: str
    devices: frozenset[str] | None = None
    deprecated: str | None = None
    effect: str = ""
    required: bool = False

    @property
    def type_name(self) -> str:
        return self.check.describe()

    def device_names(self) -> str:
        return "all" if self.devices is None else ", ".join(sorted(self.devices))


@dataclass(frozen=True)
class Validated:
    """The outcome of validating one call: values to store, keys to drop, warnings to give."""

    values: dict[str, Any]
    unset: tuple[str, ...]
    warnings: tuple[tuple[str, type[Warning]], ...]


class OptionTable(Mapping[str, Option]):
    """An ordered, immutable set of options with whole-call validation."""

    def __init__(self, title: str, rows: list[Option], moved: Mapping[str, str] | None = None) -> None:
        self.title = title
        self._rows = {row.name: row for row in rows}
        self._moved = dict(moved or {})

    def __getitem__(self, key: str) -> Option:
        return self._rows[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def defaults(self) -> dict[str, Any]:
        return {name: row.default for name, row in self._rows.items()}

    def unknown(self, key: str, source: str) -> ObsConfigError:
        if key in self._moved:
            parent = self._moved[key]
            return ObsConfigError(f"'{key}' is not a {self.title} key of its own: set it inside '{parent}', "
                                  f"e.g. {source}({parent}={{{key!r}: ...}})", option=key, source=source)
        hint = did_you_mean(str(key), tuple(self._rows))
        return ObsConfigError(f"{source}: unknown key {key!r}{hint} (run `obs options` to list every key)",
                              option=str(key), source=source)

    def validate(self, kwargs: Mapping[str, Any], *, source: str, device: str | None = None) -> Validated:
        """Check every key of one call; raise on the first bad one, before anything is applied.

        ``None`` as a value means "back to the default", and so does the default itself where the
        validator would refuse it (``''`` for an unset path): ``set_context(k=get_context(k))`` always works.  Keys
        scoped to devices other than ``device`` are validated, then dropped with a warning (sub-keys of dict options
        too).
        """
        values: dict[str, Any] = {}
        unset: list[str] = []
        notes: list[tuple[str, type[Warning]]] = []
        unknown = [k for k in kwargs if k not in self._rows]
        if unknown:
            raise self.unknown(unknown[0], source)
        for key, raw in kwargs.items():
            row = self._rows[key]
            if raw is None:
                unset.append(key)
                continue
            try:
                value = row.check(raw, key)
            except (ValueError, TypeError):
                if _is_default(raw, row.default):  # what get_context returns is always accepted back
                    unset.append(key)
                    continue
                raise
            if row.deprecated is not None:
                notes.append((f"{source}: '{key}' is deprecated; {row.deprecated}", DeprecationWarning))
            if device is not None and row.devices is not None and device not in row.devices:
                notes.append((f"{source}: '{key}' only applies on {sorted(row.devices)} and device_target is "
                              f"{device!r}; it is ignored", UserWarning))
                continue
            if device is not None and isinstance(row.check, Dict) and row.check.devices:
                value, dropped = _drop_foreign_subkeys(row.check, value, device)
                if dropped:
                    notes.append((f"{source}: '{key}' keys {dropped} only apply on other devices than "
                                  f"{device!r}; they are ignored", UserWarning))
            values[key] = value
        return Validated(values, tuple(unset), tuple(notes))


def _is_default(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def _drop_foreign_subkeys(check: Dict, value: dict[str, Any], device: str) -> tuple[dict[str, Any], list[str]]:
    kept, dropped = {}, []
    for sub, v in value.items():
        scope = check.devices.get(sub)
        if scope is not None and device not in scope:
            dropped.append(sub)
        else:
            kept[sub] = v
    return kept, dropped

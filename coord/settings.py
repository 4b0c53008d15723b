"""Strict loading of a settings table (parsed TOML, flags) into a frozen dataclass, with pydantic v2.

Each config class stays a plain frozen dataclass that other code builds directly; this module
only validates *tables* against it: exact types (a quoted ``"false"`` is not a boolean, ``"8"``
is not an integer, ``5.5`` is not a whole number of seconds), no unknown keys, no NaN or
infinity, nested tables as nested dataclasses. The first problem becomes one line that names the
setting's path and echoes the bad value, with a "did you mean" for a misspelt key::

    agent config: insecure: must be true or false without quotes (a TOML boolean, not a string), got the string 'false'
    agent config: etcd.endpointz: unknown setting (did you mean 'endpoints'?)

A check in a dataclass's ``__post_init__`` (ranges, combinations) raises its own exception,
which is passed through unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

__all__ = ["STRICT", "SettingsError", "build"]

T = TypeVar("T")

# Put on each config dataclass as ``__pydantic_config__``. Validation runs in JSON mode, where
# strict still refuses "false" for a bool and "8" for an int but lets a TOML array fill a tuple.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

SECRET_NAMES = frozenset({"password"})


class SettingsError(ValueError):
    """A settings table does not fit its dataclass (wrong type, unknown or missing key)."""


def build(cls: type[T], table: Mapping[str, Any], where: str,
          error: type[Exception] = SettingsError) -> T:
    """Validate ``table`` against the dataclass ``cls`` and build it.

    Raises ``error`` (``where`` starts its message, e.g. ``"agent config"``) for a type, key or
    shape problem, or whatever a ``__post_init__`` raised for a bad value.
    """
    if not isinstance(table, Mapping):
        raise error(f"{where}: must be a table of settings, got {_shown(table)}")
    try:
        payload = json.dumps(table, default=_unsupported)
    except TypeError as exc:
        raise error(f"{where}: {exc}") from None
    try:
        return _adapter(cls).validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if first["type"] == "value_error" and isinstance(cause, Exception):
            raise cause from None  # a __post_init__ check: its message already names the setting
        raise error(f"{where}: {describe(cls, first)}") from None


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def _unsupported(value: object) -> object:
    raise TypeError(f"{value!r} is a TOML date or time, which no setting takes")


def describe(cls: type, error: Mapping[str, Any]) -> str:
    """One pydantic error as ``path: why, got VALUE``."""
    loc = [str(part) for part in error["loc"]]
    path = ".".join(loc) or "(table)"
    kind = error["type"]
    value = "***" if loc and loc[-1] in SECRET_NAMES else _shown(error.get("input"))
    if kind == "unexpected_keyword_argument":
        known = _field_names(cls, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(known))}"
        return f"{path}: unknown setting ({hint})"
    if kind in ("missing", "missing_argument"):
        return f"{path}: required setting is missing"
    why = _WHY.get(kind)
    if why is None:
        why = str(error.get("msg", kind)).lower()
    if kind.startswith("bool") and isinstance(error.get("input"), str):
        why = "must be true or false without quotes (a TOML boolean, not a string)"
    return f"{path}: {why}, got {value}"


_WHY = {
    "bool_type": "must be true or false (a TOML boolean)",
    "bool_parsing": "must be true or false (a TOML boolean)",
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "dataclass_type": "must be a table",
    "dict_type": "must be a table",
}


def _shown(value: object) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"the list {value!r}"
    return repr(value)


def _field_names(cls: type, path: list[str]) -> list[str]:
    """Field names of the dataclass reached from ``cls`` through ``path`` (nested tables)."""
    for name in path:
        hint = _hints(cls).get(name)
        nested = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
        if nested is None:
            return []
        cls = nested  # type: ignore[assignment]
    return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation only loses the hint
        return {}

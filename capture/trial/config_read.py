"""Reading one TOML table of a trial config: typed getters that name the full key, did-you-mean
for unknown keys, and values quoted without credentials.

Every quoted value goes through :func:`shown` (``repr`` of the value with credentials removed by
:mod:`capture.redact`), so an error never prints a secret, while the key names and the lists of
known keys stay as written (redacting the whole message would mangle them).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from capture.errors import ConfigError
from capture.redact import redact_value

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "a table"}


def shown(value: Any) -> str:
    """``repr(value)`` with every credential inside it removed."""
    return repr(redact_value(value))


def type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def near(key: str, known: list[str] | tuple[str, ...]) -> list[str]:
    """Close spellings, and abbreviations by initials (learning_rate → lr)."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return close
    initials = "".join(w[:1] for w in key.split("_") if w)
    return [k for k in known if len(k) > 1 and k in (initials, "".join(w[:1] for w in k.split("_")))][:1]


def did_you_mean(value: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_FLAG_HINT = "`capture trial --help` lists the flags; docs/trial.md the settings they override"


def _int_shown(value: int) -> str:
    """An integer for an error line: a huge one by its first digits and its length."""
    digits = str(value)
    return digits if len(digits) <= 24 else f"{digits[:12]}... ({len(digits)} digits)"


def check_int(value: Any, key: str, minimum: int, maximum: int | None = None, hint: str = _FLAG_HINT) -> None:
    """A command-line integer within the bounds of the setting it overrides."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer, got {shown(value)}", hint)
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {_int_shown(value)}", hint)
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}: must be <= {maximum:,}, got {_int_shown(value)}", hint)


def check_choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {shown(value)}", _FLAG_HINT)


class Table:
    """One TOML table being read: typed getters that name the full key, then unknown-key check."""

    def __init__(self, data: Any, path: str, hint: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must be a table, got {type_name(data)}", hint)
        self.data, self.path, self.hint = data, path, hint
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}"

    def err(self, name: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.key(name)}: {msg}", self.hint)

    def has(self, name: str) -> bool:
        return name in self.data

    def get(self, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
        self.used.add(name)
        if name not in self.data:
            return default
        value = self.data[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise self.err(name, f"must be {want}, got {type_name(value)} {shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):  # TOML writes inf and nan; no setting means them
            raise self.err(name, f"must be a finite number, got {value}")
        return value

    def int(self, name: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
        value = self.get(name, int, default)
        if minimum is not None and value < minimum:
            raise self.err(name, f"must be >= {minimum}, got {_int_shown(value)}")
        if maximum is not None and value > maximum:
            raise self.err(name, f"must be <= {maximum:,}, got {_int_shown(value)}")
        return value

    def positive(self, name: str, default: float) -> float:
        value = self.get(name, float, default)
        if not value > 0:
            raise self.err(name, f"must be > 0, got {value:g}")
        return value

    def fraction(self, name: str, default: float, upper_open: bool = True) -> float:
        value = self.get(name, float, default)
        if not (0.0 <= value < 1.0 if upper_open else 0.0 <= value <= 1.0):
            raise self.err(name, f"must be in [0, 1{')' if upper_open else ']'}, got {value:g}")
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: str) -> str:
        value = self.get(name, str, default)
        if value not in choices:
            raise self.err(name, f"must be one of {', '.join(choices)}, got {shown(value)}{did_you_mean(value, choices)}")
        return value

    def strings(self, name: str, default: tuple[str, ...] | None) -> tuple[str, ...] | None:
        value = self.get(name, list, None)
        if value is None:
            return default
        if not all(isinstance(v, str) and v for v in value):
            raise self.err(name, "must be an array of non-empty strings")
        return tuple(value)

    def table(self, name: str) -> "Table":
        self.used.add(name)
        return Table(self.data.get(name, {}), self.key(name), self.hint)

    def only_with(self, name: str, value: Any, condition: bool, requirement: str) -> None:
        """``name`` was given although ``requirement`` does not hold."""
        if value is not None and not condition:
            raise self.err(name, f"only used when {requirement}")

    def done(self) -> None:
        for key in self.data:
            if key not in self.used:
                close = near(key, sorted(self.used))
                extra = f" (did you mean {close[0]}?)" if close else f"; known keys: {', '.join(sorted(self.used))}"
                raise ConfigError(f"{self.key(key)}: unknown key{extra}", self.hint)

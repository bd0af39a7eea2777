"""The preflight for people: the terminal table, and aligned rows for `capture compare`."""

from __future__ import annotations

from typing import Any

from capture.fmt import MISSING, number_str, seconds_str
from capture.termtable import keep_units, wrap

_MARK = {"pass": "ok", "warn": "WARN", "fail": "FAIL", "skipped": "-"}


def _table(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest dict or its ``[preflight]`` table -> the table (empty if there is none)."""
    if not isinstance(data, dict):
        return {}
    inner = data.get("preflight")
    return inner if isinstance(inner, dict) else (data if "checks" in data else {})


def _value(check: dict[str, Any]) -> str:
    v = check.get("value")
    if v is None:
        return MISSING
    text = number_str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
    return f"{text} {check['unit']}" if check.get("unit") else text


def render(data: dict[str, Any], verbose: bool = False, width: int = 100) -> str:
    """The preflight table as `capture preflight` prints it, within ``width`` columns (the last
    column wrapped at words under itself, or below the row where it would be narrower than 30);
    skipped checks only with ``verbose``."""
    t = _table(data)
    checks = [c for c in t.get("checks", []) if isinstance(c, dict)]
    rows = [("check", "dev", "result", "value", "expected / reason")]
    for c in checks:
        if c.get("verdict") == "skipped" and not verbose:
            continue
        dev = str(c["device"]) if c.get("device") is not None else ""
        note = c.get("reason", "") if c.get("verdict") != "pass" or not c.get("expected") else c["expected"]
        rows.append((str(c.get("name", "?")), dev, _MARK.get(c.get("verdict", ""), "?"), _value(c), note))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    indent = sum(widths) + 2 * 4
    lines = []
    for r in rows:
        head = "  ".join(r[k].ljust(widths[k]) for k in range(4)) + "  "
        if width - indent >= 30:
            lines += _wrap(r[4], width, head, " " * indent)
        else:
            lines += [head.rstrip(), *_wrap(r[4], width, "    ", "    ")]
    skipped = sum(1 for c in checks if c.get("verdict") == "skipped")
    counts = {v: sum(1 for c in checks if c.get("verdict") == v) for v in ("pass", "warn", "fail")}
    summary = (f"preflight {t.get('verdict', '?')} ({t.get('mode', '?')}, {t.get('device_kind', '?')}, "
               f"{seconds_str(t.get('duration_s'))}): {counts['pass']} passed, {counts['warn']} warned, "
               f"{counts['fail']} failed" + (f", {skipped} skipped" + ("" if verbose else " (--all lists them)") if skipped else ""))
    return "\n".join([*lines, "", *_wrap(summary, width, "", "  ")]) + "\n"


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    """``text`` after ``first``, continued under ``rest``, broken at spaces only (a long word overruns),
    never between a number and what follows it ("8 MiB", "1455 of 1980 MHz" keeps "1980 MHz")."""
    return wrap(keep_units(text), width, first, rest, cut_long=False)


def preflight_rows(data_a: dict[str, Any], data_b: dict[str, Any]) -> list[dict[str, Any]]:
    """Checks of two manifests side by side, aligned on (name, device), in A's order then B's extras.

    Each row: ``name``, ``device``, ``unit``, ``a`` / ``b`` (value or None), ``verdict_a`` /
    ``verdict_b`` (None where that manifest has no such check), ``ratio`` (b / a for numbers).
    """
    def index(data: dict[str, Any]) -> dict[tuple[Any, Any], dict[str, Any]]:
        return {(c.get("name"), c.get("device")): c for c in _table(data).get("checks", []) if isinstance(c, dict)}

    a, b = index(data_a), index(data_b)
    keys = list(a) + [k for k in b if k not in a]
    rows = []
    for key in keys:
        ca, cb = a.get(key, {}), b.get(key, {})
        va, vb = ca.get("value"), cb.get("value")
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        rows.append({"name": key[0], "device": key[1], "unit": ca.get("unit") or cb.get("unit"),
                     "a": va, "b": vb, "verdict_a": ca.get("verdict"), "verdict_b": cb.get("verdict"),
                     "ratio": vb / va if numeric and va else None})
    return rows

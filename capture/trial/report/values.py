"""Reading a manifest dict that may be incomplete or foreign, and formatting a value by its key's unit."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from capture.fmt import bytes_str, number_str, percent_str, seconds_str
from capture.manifest import dig

NOT_MEASURED = "not measured"


def _table(data: Any, dotted: str) -> dict[str, Any] | None:
    value = dig(data, dotted)
    return dict(value) if isinstance(value, Mapping) else None


def _first(table: Mapping[str, Any] | None, *keys: str) -> Any:
    if not table:
        return None
    for k in keys:
        if table.get(k) is not None:
            return table[k]
    return None


def _is_num(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(v: Any) -> list[float]:
    if not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        return []
    return [float(x) for x in v if _is_num(x)]


_PERCENT_SUFFIXES = ("_fraction", "_ratio", "_cv", "_share", "_error", "mfu", "headroom")


def fmt_value(key: str, v: Any) -> str:
    """Format by the unit in the key's name (``_bytes``, ``_s``, ``_per_s``, ``_share`` ...)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, Mapping):  # ``state_bytes_by_dtype``: each value in the unit of ``state_bytes``
        return ", ".join(f"{k}={fmt_value(key.rpartition('_by_')[0] if '_by_' in key else str(k), x)}" for k, x in v.items())
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        nums = _numbers(v)
        if len(v) > 6 and (nums or not all(isinstance(x, str) for x in v)):
            return f"{len(v)} values" + (f" ({fmt_value(key, min(nums))} .. {fmt_value(key, max(nums))})" if nums else "")
        if len(v) > 24:  # names (LoRA's target modules, saved components): the first ones, then a count
            return ", ".join(str(x) for x in v[:20]) + f" and {len(v) - 20} more"
        return ", ".join(fmt_value(key, x) for x in v) if v else "none"
    if not _is_num(v):
        return str(v)
    if key.endswith("_per_s"):
        if key.startswith("bytes") or key.endswith("bytes_per_s"):
            return f"{bytes_str(v)}/s"
        if "token" in key:
            return f"{v:,.0f} tok/s"
        return f"{v:,.4g}/s"
    if key.endswith("_bytes"):
        return bytes_str(v)
    if key.endswith("_s"):
        return seconds_str(v)
    if key.endswith(_PERCENT_SUFFIXES) or key == "cv" or key.startswith("mfu_"):  # mfu_6n, mfu_with_attention
        return f"{v * 100:+.1f} %" if key.endswith("_error") else percent_str(v, 2)
    if key.endswith("_w"):
        return f"{v:.0f} W"
    if key.endswith("_h"):
        return f"{v:.2f} h"
    if isinstance(v, int):
        return number_str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        return f"{v:.4g}"
    return f"{v:.6g}"


def _label(key: str) -> str:
    if key.endswith("_per_s"):
        return key[: -len("_per_s")].replace("_", " ") + "/s"
    for suffix in ("_bytes", "_s"):
        if key.endswith(suffix) and key != suffix:
            key = key[: -len(suffix)]
            break
    return key.replace("_", " ")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


"""The one comparison engine: flatten two manifests, compare them field by field under a policy.

`capture verify` (recorded vs live), `capture diff A B` (default policy) and `capture compare A B`
(review policy, :meth:`~capture.verify.policy.Policy.review`) all call :func:`compare_manifests`,
so they cannot disagree on whether two stacks differ in a field they both compare.

Code drift: when both sides carry ``[code.files]`` (path -> blob id, bounded; see
docs/architecture.md), a difference in ``code.tree_hash`` or ``code.commit`` says which files
changed, were added or removed, and whether the work tree is now dirty. Past the bound
(``code.files_truncated = true``) it says that the list is partial.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from capture.termtable import wrap
from capture.verify.open import Trust, open_manifest
from capture.verify.policy import Policy


class _Absent:
    """A field present on one side only."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "(absent)"

    def __str__(self) -> str:
        return "(absent)"

    def __reduce__(self) -> str:  # pickled across the tree's process pool: stays the one instance
        return "ABSENT"


ABSENT: Any = _Absent()

# Natural keys of arrays of tables, so that reordering is not drift and a device is compared
# with the same device.
_ARRAY_KEYS = {
    "devices": ("index",),
    "models": ("repo_id", "spec", "path"),
    "datasets": ("repo_id", "spec", "path"),
    "files": ("path",),
    "links": ("a", "b"),
    "mig_instances": ("uuid", "index"),
    "checks": ("name",),
}
CODE_FILES_SHOWN = 10
"""How many file names a code-drift line names before "and N more"."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaf values; arrays of tables are keyed by their natural key."""
    out: dict[str, Any] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and data and all(isinstance(x, Mapping) for x in data):
        name = prefix.rsplit(".", 1)[-1]
        keys = _ARRAY_KEYS.get(name, ())
        for pos, item in enumerate(data):
            ident = next((item[k] for k in keys if k in item and not isinstance(item[k], (dict, list))), None)
            if name == "links" and "a" in item and "b" in item:
                ident = f"{item['a']}-{item['b']}"
            out.update(flatten(item, f"{prefix}.{ident if ident is not None else pos}"))
    elif isinstance(data, list):
        out[prefix] = tuple(data)
    else:
        out[prefix] = data
    return out


def _lenient_version(value: Any) -> Version | None:
    text = str(value).strip()
    try:
        return Version(text)
    except InvalidVersion:
        m = re.match(r"v?(\d+(?:\.\d+)*)", text)  # "6.2.41133-dd7f95766", "580.159.04"
        return Version(m.group(1)) if m else None


def show_value(value: Any) -> str:
    """A value in a report line: JSON, so control characters from a file arrive escaped."""
    if value is ABSENT:
        return "(absent)"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, default=str)


@dataclass(frozen=True)
class Difference:
    """One field whose live (or second) value does not satisfy the policy."""

    field: str
    recorded: Any
    live: Any
    rule: str = "equal"
    detail: str | None = None
    """For code drift: the files changed, added and removed, and whether the tree is now dirty."""

    def line(self, left: str = "recorded", right: str = "live") -> str:
        text = f"{json.dumps(self.field)[1:-1]}: {left} {show_value(self.recorded)}, {right} {show_value(self.live)}"
        if self.rule != "equal":
            text += f" (policy {self.rule})"
        if self.detail:
            text += f"; {self.detail}"
        return text

    def lines(self, left: str = "recorded", right: str = "live", width: int = 100, indent: int = 2) -> list[str]:
        """:meth:`line` where it fits in ``width`` columns after ``indent``; else the field on its
        line and each side on its own below it (a value is never cut)."""
        one = self.line(left, right)
        if indent + len(one) <= width:
            return [one]
        out = [f"{json.dumps(self.field)[1:-1]}:", f"  {left} {show_value(self.recorded)}",
               f"  {right} {show_value(self.live)}"]
        if self.rule != "equal":
            out.append(f"  policy {self.rule}")
        if self.detail:  # file names are not cut: a longer one overruns the width
            out += wrap(self.detail, max(20, width - indent), "  ", "    ", cut_long=False)
        return out

    def to_json(self, left: str = "recorded", right: str = "live") -> dict[str, Any]:
        out: dict[str, Any] = {"field": self.field, left: None if self.recorded is ABSENT else self.recorded,
                               right: None if self.live is ABSENT else self.live, "rule": self.rule}
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True)
class CodeChanges:
    """What changed between two ``[code.files]`` tables."""

    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    now_dirty: bool = False
    partial: bool = False
    """One side listed only part of its files (``files_truncated``): more may differ."""

    def describe(self) -> str | None:
        parts = []
        for word, names in (("changed", self.changed), ("added", self.added), ("removed", self.removed)):
            if names:
                shown = ", ".join(names[:CODE_FILES_SHOWN])
                more = f" and {len(names) - CODE_FILES_SHOWN} more" if len(names) > CODE_FILES_SHOWN else ""
                parts.append(f"{len(names)} file(s) {word}: {shown}{more}")
        if self.now_dirty:
            parts.append("the work tree is now dirty (uncommitted changes)")
        if self.partial:
            parts.append("the file list is past its bound (files_truncated), so other files may differ too")
        return "; ".join(parts) or None


def code_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> CodeChanges | None:
    """File-level code drift from A to B; None when a side has no ``[code]`` table."""
    ca, cb = a.get("code"), b.get("code")
    if not isinstance(ca, Mapping) or not isinstance(cb, Mapping):
        return None
    fa, fb = ca.get("files"), cb.get("files")
    now_dirty = cb.get("dirty") is True and ca.get("dirty") is not True
    if not isinstance(fa, Mapping) or not isinstance(fb, Mapping):
        return CodeChanges(now_dirty=now_dirty) if now_dirty else None
    return CodeChanges(
        changed=tuple(sorted(p for p in set(fa) & set(fb) if fa[p] != fb[p])),
        added=tuple(sorted(set(fb) - set(fa))),
        removed=tuple(sorted(set(fa) - set(fb))),
        now_dirty=now_dirty,
        partial=bool(ca.get("files_truncated") is True or cb.get("files_truncated") is True),
    )


def compare_manifests(recorded: Mapping[str, Any], live: Mapping[str, Any],
                      policy: Policy | None = None) -> tuple[list[Difference], int]:
    """Compare two manifest dicts field by field. Returns (differences, number of fields compared)."""
    policy = policy or Policy.default()
    a, b = flatten(recorded), flatten(live)
    diffs: list[Difference] = []
    compared = 0
    for key in sorted(set(a) | set(b)):
        if key.startswith("code.files."):
            continue  # summarised on the code.tree_hash / code.commit line, not one field per file
        rule = policy.rule_for(key)
        if rule is None:
            continue
        compared += 1
        va, vb = a.get(key, ABSENT), b.get(key, ABSENT)
        if rule.kind == "specifier":
            live_version = None if vb is ABSENT else _lenient_version(vb)
            if live_version is None or not SpecifierSet(rule.spec).contains(live_version, prereleases=True):
                diffs.append(Difference(key, va, vb, rule.spec))
        elif va != vb:
            diffs.append(Difference(key, va, vb))
    code_keys = [i for i, d in enumerate(diffs) if d.field in ("code.tree_hash", "code.commit")]
    if code_keys:
        changes = code_changes(recorded, live)
        detail = changes.describe() if changes else None
        if detail:
            i = code_keys[-1] if diffs[code_keys[-1]].field == "code.tree_hash" else code_keys[0]
            d = diffs[i]
            diffs[i] = Difference(d.field, d.recorded, d.live, d.rule, detail)
    return diffs, compared


def diff_files(a: str | os.PathLike[str], b: str | os.PathLike[str], policy: Policy | None = None,
               everything: bool = False, trust: Trust = None) -> tuple[list[Difference], int]:
    """`capture diff A B`: the verify comparison between two manifests (no live probe).

    Both files go through the door without requiring trust (their signature state is reported by
    the command); ``everything`` compares every field except timestamps and tool metadata.
    """
    da = open_manifest(a, trust, require_trusted=False).data
    db = open_manifest(b, trust, require_trusted=False).data
    return compare_manifests(da, db, Policy.everything() if everything else policy)

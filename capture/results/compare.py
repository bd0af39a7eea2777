"""`capture compare A B`: two runs side by side, what changed in the stack first, then the figures.

The point is to see at a glance *why* run B was 12% slower: a driver, a torch build, a package,
the code, the model revision or the image changed, and then by how much each trial figure
moved. The stack part is the verify engine (:func:`capture.verify.compare.compare_manifests`)
under the review policy (:meth:`capture.verify.policy.Policy.review`: every field `capture diff`
compares, plus host, environment, image and run definition), so `diff` and `compare` agree on
whether two stacks differ. The trial figures are this module's own part.

Manifests are opened through the door without requiring trust; the header says whether each
signature is valid and its signer trusted (the command exits 4 for an unsigned or invalid one
unless ``--allow-unsigned``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from capture._escape import printable
from capture.fmt import bytes_str, number_str
from capture.results.summary import RunSummary, dig, summarize
from capture.trial.report.checks import HIGH_CV
from capture.verify.compare import ABSENT, Difference, compare_manifests
from capture.verify.open import SignatureStatus, open_manifest
from capture.verify.policy import Policy

# The group a stack field is shown under: the first prefix that matches wins.
GROUPS: tuple[tuple[str, str], ...] = (
    ("nvidia.driver_version", "driver"),
    ("nvidia.cuda_driver_version", "driver"),
    ("amd.driver_version", "driver"),
    ("accelerator.runtime", "CUDA/ROCm"),
    ("framework.cuda_version", "CUDA/ROCm"),
    ("framework.hip_version", "CUDA/ROCm"),
    ("accelerator.", "accelerator"),
    ("nvidia.", "accelerator"),
    ("amd.", "accelerator"),
    ("framework.", "framework"),
    ("python.", "python"),
    ("code.", "code"),
    ("container.", "image"),
    ("host.", "host"),
    ("environment.", "environment"),
    ("models.", "models"),
    ("datasets.", "datasets"),
    ("trial.run.", "run definition"),
)


def group_of(field: str) -> str:
    return next((g for prefix, g in GROUPS if field.startswith(prefix)), field.split(".", 1)[0])


# (name in Figures, label, unit, True when higher is better; None when neither)
FIGURES: tuple[tuple[str, str, str, bool | None], ...] = (
    ("tokens_per_s", "tokens/s", "", True),
    ("step_time_median_s", "step time median", "s", False),
    ("step_time_p90_s", "step time p90", "s", False),
    ("peak_memory_bytes", "peak memory", "bytes", False),
    ("mfu", "MFU", "", True),
    ("checkpoint_write_s", "checkpoint write", "s", False),
    ("cost_per_million_tokens", "cost / M tokens", "", False),
    ("recovery_verdict", "recovery", "", None),
)


NOISE_FIGURES = frozenset({"tokens_per_s", "step_time_median_s", "step_time_p90_s"})
NOISE_RULE = ("a change in step time or tokens/s is significant only when |B - A| / A exceeds the sum of the two "
              "runs' step-time coefficients of variation (CV_A + CV_B); smaller changes are within noise")


def significant(a: float | None, b: float | None, cv_a: float | None, cv_b: float | None) -> bool | None:
    """:data:`NOISE_RULE`; None when either CV (or A) is unknown."""
    if a is None or b is None or not a or cv_a is None or cv_b is None:
        return None
    return abs(b - a) / abs(a) > cv_a + cv_b


@dataclass(frozen=True)
class Change:
    group: str
    field: str
    a: Any
    """Value in run A; None when absent there."""
    b: Any
    detail: str | None = None
    """Code drift: the files changed, added and removed (see :class:`capture.verify.compare.CodeChanges`)."""

    def to_json(self) -> dict[str, Any]:
        out = {"group": self.group, "field": self.field, "a": self.a, "b": self.b}
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True)
class PackageChanges:
    added: tuple[tuple[str, str], ...] = ()
    removed: tuple[tuple[str, str], ...] = ()
    changed: tuple[tuple[str, str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass(frozen=True)
class FigureChange:
    name: str
    label: str
    unit: str
    a: Any
    b: Any
    relative_change: float | None
    """(B - A) / A; None when either is missing, A is zero, or the figure is not a number."""
    verdict: str
    """``better``, ``worse``, ``same``, ``within noise``, ``changed`` or ``not comparable``."""
    significant: bool | None = None
    """Step time and tokens/s only: whether the change exceeds the two runs' measured variation
    (:data:`NOISE_RULE`); None where a CV is missing or the figure has no noise measure."""


@dataclass(frozen=True)
class Side:
    path: str
    summary: RunSummary
    signature: SignatureStatus


@dataclass(frozen=True)
class Comparison:
    a: Side
    b: Side
    stack: tuple[Change, ...]
    packages: PackageChanges
    figures: tuple[FigureChange, ...]
    preflight: tuple[dict[str, Any], ...] = ()
    """The two manifests' preflight checks aligned (capture.preflight.report.preflight_rows)."""

    def to_json(self) -> dict[str, Any]:
        def side(s: Side) -> dict[str, Any]:
            return {"path": s.path, "signature": s.signature.to_json(), "summary": s.summary.to_json()}
        return {
            "a": side(self.a), "b": side(self.b),
            "stack": [c.to_json() for c in self.stack],
            "packages": {
                "added": [{"name": n, "version": v} for n, v in self.packages.added],
                "removed": [{"name": n, "version": v} for n, v in self.packages.removed],
                "changed": [{"name": n, "a": x, "b": y} for n, x, y in self.packages.changed],
            },
            "figures": [asdict(f) for f in self.figures],
            "preflight": list(self.preflight),
        }


def _value_or_none(v: Any) -> Any:
    return None if v is ABSENT else v


def _package_version(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return str(entry)
    v = str(entry.get("version", "?"))
    if entry.get("commit"):
        v += f" ({entry.get('source', 'vcs')} {str(entry['commit'])[:12]})"
    return v


def _packages(data: Mapping[str, Any]) -> Mapping[str, Any]:
    p = dig(data, "python.packages")
    return p if isinstance(p, Mapping) else {}


def stack_differences(a: Mapping[str, Any], b: Mapping[str, Any], policy: Policy | None = None) -> list[Difference]:
    """The engine's differences between two manifests under the review policy."""
    return compare_manifests(a, b, policy or Policy.review())[0]


def split_differences(a: Mapping[str, Any], b: Mapping[str, Any],
                      diffs: list[Difference]) -> tuple[list[Change], PackageChanges]:
    """Differences as the reviewer reads them: packages on their own, the rest by group."""
    pa, pb = _packages(a), _packages(b)
    touched: set[str] = set()
    changes: list[Change] = []
    for d in diffs:
        parts = d.field.split(".")
        if parts[:2] == ["python", "packages"] and len(parts) > 2:
            name = next((n for n in (*pa, *pb) if d.field.startswith(f"python.packages.{n}.")), parts[2])
            touched.add(name)
            continue
        changes.append(Change(group_of(d.field), d.field, _value_or_none(d.recorded), _value_or_none(d.live), d.detail))
    added = tuple((n, _package_version(pb[n])) for n in sorted(touched) if n not in pa and n in pb)
    removed = tuple((n, _package_version(pa[n])) for n in sorted(touched) if n in pa and n not in pb)
    changed = tuple((n, _package_version(pa[n]), _package_version(pb[n])) for n in sorted(touched)
                    if n in pa and n in pb)
    return changes, PackageChanges(added, removed, changed)


def stack_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Change]:
    return split_differences(a, b, stack_differences(a, b))[0]


def package_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> PackageChanges:
    return split_differences(a, b, stack_differences(a, b))[1]


def figure_changes(a: RunSummary, b: RunSummary) -> list[FigureChange]:
    out = []
    for name, label, unit, higher_better in FIGURES:
        va, vb = getattr(a.figures, name), getattr(b.figures, name)
        if va is None and vb is None:
            continue
        rel = None
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
            rel = (vb - va) / abs(va)
        if va is None or vb is None:
            verdict = "not comparable"
        elif va == vb:
            verdict = "same"
        elif higher_better is None or rel is None:
            verdict = "changed"
        else:
            verdict = "better" if (rel > 0) == higher_better else "worse"
        sig = significant(va, vb, a.figures.step_time_cv, b.figures.step_time_cv) if name in NOISE_FIGURES else None
        if sig is False and verdict in ("better", "worse"):
            verdict = "within noise"
        if name == "peak_memory_bytes" and a.figures.peak_memory_source != b.figures.peak_memory_source:
            label = f"peak memory ({a.figures.peak_memory_source} vs {b.figures.peak_memory_source})"
            verdict = "not comparable" if verdict in ("better", "worse") else verdict
        out.append(FigureChange(name, label, unit, va, vb, rel, verdict, sig))
    return out


def _load(path: str, allowed_signers: str | os.PathLike[str] | None) -> tuple[Side, dict[str, Any]]:
    opened = open_manifest(path, allowed_signers, require_trusted=False)  # the header reports trust
    status = opened.signature
    return Side(path, summarize(opened.data, opened.raw, path, status.principal, status.fingerprint), status), opened.data


def compare_files(a: str, b: str, allowed_signers: str | os.PathLike[str] | None = None) -> Comparison:
    side_a, da = _load(a, allowed_signers)
    side_b, db = _load(b, allowed_signers)
    stack, packages = split_differences(da, db, stack_differences(da, db))
    from capture.preflight.report import preflight_rows

    return Comparison(side_a, side_b, tuple(stack), packages, tuple(figure_changes(side_a.summary, side_b.summary)),
                      tuple(preflight_rows(da, db)))


def _value(v: Any, unit: str = "") -> str:
    if v is None:
        return "(absent)"
    if unit == "bytes" and isinstance(v, (int, float)):
        return bytes_str(v)
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return number_str(v) + (f" {unit}" if unit else "")
    return printable(v)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(c: Comparison) -> str:
    lines = []
    for name, s in (("A", c.a), ("B", c.b)):
        sm = s.summary
        lines.append(printable(f"{name}: {s.path} ({sm.kind}, {sm.accelerator}, created {sm.created_utc}, id {sm.content_id})"))
        lines.append(f"   {s.signature.label}")
    lines.append("")
    n = len(c.stack) + (1 if c.packages else 0)
    if n == 0:
        lines.append("Stack: same (no difference in accelerator, driver, CUDA/ROCm, framework, packages, code, "
                     "models, datasets, image, host, run definition)")
    else:
        lines.append("Stack: what changed from A to B")
        rows = [[ch.group, printable(ch.field), _value(ch.a), "->", _value(ch.b)] for ch in c.stack]
        if rows:
            lines.extend(_table(rows))
        lines.extend(f"    {ch.field}: {printable(ch.detail)}" for ch in c.stack if ch.detail)
        p = c.packages
        if p:
            lines.append(f"  packages: {len(p.changed)} changed, {len(p.added)} added, {len(p.removed)} removed")
            prow = [[printable(n), printable(a), "->", printable(b)] for n, a, b in p.changed]
            prow += [[printable(n), "(absent)", "->", printable(v)] for n, v in p.added]
            prow += [[printable(n), printable(v), "->", "(absent)"] for n, v in p.removed]
            lines.extend(_table(prow, "    "))
    lines.append("")
    if not c.figures:
        lines.append("Trial figures: none in either manifest (fingerprints only)")
    else:
        lines.append("Trial figures (B relative to A)")
        rows = []
        for f in c.figures:
            rel = f"{f.relative_change:+.1%}" if f.relative_change is not None else ""
            unit = f.unit if f.unit != "bytes" else "bytes"
            rows.append([f.label, _value(f.a, unit), "->", _value(f.b, unit), rel, f.verdict])
        lines.extend(_table(rows))
        cvs = [(n, s.summary.figures.step_time_cv) for n, s in (("A", c.a), ("B", c.b))]
        lines.append("  step-time CV: " + ", ".join(f"{n} {cv * 100:.2f} %" if cv is not None else f"{n} not measured"
                                                   for n, cv in cvs) + f"; {NOISE_RULE}")
        for n, cv in cvs:
            if cv is not None and cv > HIGH_CV:
                lines.append(f"  {n}: step-time CV {cv * 100:.1f} % is high (above {HIGH_CV * 100:.0f} %): "
                             "its step time and tokens/s are noisy")
    if c.preflight:
        lines += ["", "Preflight (B relative to A)"]
        rows = [[printable(str(r["name"])) + ("" if r["device"] is None else f" (device {r['device']})"),
                 _value(r["a"], r["unit"] or ""), "->", _value(r["b"], r["unit"] or ""),
                 f"x{r['ratio']:.2f}" if r["ratio"] is not None else "",
                 f"{r['verdict_a'] or '-'} -> {r['verdict_b'] or '-'}"] for r in c.preflight]
        lines.extend(_table(rows))
    return "\n".join(lines)

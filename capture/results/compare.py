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

from capture import costs
from capture.manifest import dig, table_at
from capture.results.summary import RunSummary, summarize
from capture.verify.compare import ABSENT, Difference, compare_manifests
from capture.verify.open import SignatureStatus, open_manifest
from capture.verify.policy import Policy

RUN_DEFINITION = "run definition"
"""The group of the trial's settings (``trial.run.*``): two runs that differ there are not comparable."""
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
    ("trial.run.", RUN_DEFINITION),
)


def group_of(field: str) -> str:
    return next((g for prefix, g in GROUPS if field.startswith(prefix)), field.split(".", 1)[0])


# (name, label, unit, True when higher is better (None: neither), judged by the noise rule)
FIGURES: tuple[tuple[str, str, str, bool | None, bool], ...] = (
    ("tokens_per_s", "tokens/s", "", True, True),
    ("step_time_median_s", "step time median", "s", False, True),
    ("step_time_p90_s", "step time p90", "s", False, True),
    ("mfu", "MFU", "fraction", True, True),
    ("peak_memory_bytes", "peak memory", "bytes", False, False),
    ("checkpoint_write_s", "checkpoint write", "s", False, False),
    ("trial_cost", costs.TRIAL_COST, "money", False, False),
    ("steady_cost_per_million_tokens", costs.STEADY_COST, "money", False, True),
    ("projected_cost", "projected cost to the target", "money", False, True),
    ("projected_time_s", "projected time to the target", "s", False, True),
    ("recovery_verdict", "recovery", "", None, False),
)
"""Every figure derived from throughput (step time, tokens/s, MFU, steady-state and projected cost
and time) is judged by the one noise rule, so tokens/s and MFU never disagree."""


NOISE_FIGURES = frozenset(name for name, *_, noise in FIGURES if noise)
NOISE_RULE = ("a change in a figure derived from throughput (step time, tokens/s, MFU, steady-state and projected "
              "cost and time) is significant only when |B - A| / A exceeds the sum of the two runs' step-time "
              "coefficients of variation (CV_A + CV_B); smaller changes are within noise")


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
    """Throughput-derived figures only: whether the change exceeds the two runs' measured variation
    (:data:`NOISE_RULE`); None where a CV is missing or the figure has no noise measure."""
    why: str | None = None
    """Why two values are not compared (different bases, currencies, or trial stages)."""
    basis_a: str | None = None
    basis_b: str | None = None
    """What each value measures (peak memory) or is stated in (a currency)."""


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
    return table_at(data, "python.packages")


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


def _value_of(s: RunSummary, name: str) -> Any:
    if hasattr(s.figures, name):
        return getattr(s.figures, name)
    c = s.costs
    return getattr(c, name, None) if c is not None else None


def _basis(s: RunSummary, name: str, unit: str) -> str | None:
    if name == "peak_memory_bytes":
        return s.figures.peak_memory_basis
    if unit == "money" and s.costs is not None:
        return s.costs.currency
    return None


def _like_for_like(a: RunSummary, b: RunSummary, name: str, unit: str, phases: tuple[Any, Any]) -> str | None:
    """Why A and B are not the same kind of figure (then neither better nor worse), or None."""
    ba, bb = _basis(a, name, unit), _basis(b, name, unit)
    if ba != bb and ba is not None and bb is not None:
        return f"{ba} vs {bb}"
    if name == "trial_cost" and phases[0] != phases[1]:
        return "the trials ran different stages"
    return None


def figure_changes(a: RunSummary, b: RunSummary, phases: tuple[Any, Any] = (None, None),
                   same_run: bool = True) -> list[FigureChange]:
    """Each figure of B against A. ``phases``: the names of each trial's phases (trial cost is
    like-for-like only between trials that ran the same stages); ``same_run``: False when the two
    trials measured different run definitions (then no figure is better or worse)."""
    out = []
    for name, label, unit, higher_better, noise in FIGURES:
        va, vb = _value_of(a, name), _value_of(b, name)
        if va is None and vb is None:
            continue
        rel = None
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
            rel = (vb - va) / abs(va)
        why = _like_for_like(a, b, name, unit, phases)
        if not same_run and higher_better is not None and why is None:
            why = "different run definitions (see the stack's run definition)"
        sig = significant(va, vb, a.figures.step_time_cv, b.figures.step_time_cv) if noise else None
        if va is None or vb is None:
            verdict = "not comparable"
        elif why:
            verdict = "not comparable"
        elif va == vb:
            verdict = "same"
        elif higher_better is None or rel is None:
            verdict = "changed"
        elif sig is False:
            verdict = "within noise"
        else:
            verdict = "better" if (rel > 0) == higher_better else "worse"
        out.append(FigureChange(name, label, unit, va, vb, rel, verdict, sig, why,
                                _basis(a, name, unit), _basis(b, name, unit)))
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

    from capture.decide.runs import run_definition

    phases = tuple(tuple(sorted(p)) if isinstance(p, Mapping) else None
                   for p in (dig(da, "trial.cost.phases"), dig(db, "trial.cost.phases")))
    same_run = "trial" not in da or "trial" not in db or run_definition(da) == run_definition(db)
    return Comparison(side_a, side_b, tuple(stack), packages,
                      tuple(figure_changes(side_a.summary, side_b.summary, phases, same_run)),  # type: ignore[arg-type]
                      tuple(preflight_rows(da, db)))


def render(c: Comparison, width: int | None = None, everything: bool = False) -> str:
    """The comparison for a terminal (:mod:`capture.results.compare_text`)."""
    from capture.results.compare_text import render as _render

    return _render(c, width, everything)

"""`capture compare A B`: two runs side by side, what changed in the stack first, then the figures.

The point is to see at a glance *why* run B was 12% slower: a driver, a torch build, a package,
the code, the model revision or the image changed, and then by how much each trial figure
moved. Manifests are read without requiring trust; the header says whether each signature is
valid and its signer trusted. (`capture diff` is the verify policy's comparison; this is the
reviewer's view of two results.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from capture.manifest import parse_body, read_bytes, split_signed
from capture.results._sig import SignatureStatus, signature_status
from capture.fmt import bytes_str, number_str
from capture.results.summary import RunSummary, dig, summarize

# (group, dotted path); a path ending in ".*" compares every key of that table.
STACK_FIELDS: tuple[tuple[str, str], ...] = (
    ("accelerator", "accelerator.vendor"),
    ("accelerator", "accelerator.model"),
    ("accelerator", "accelerator.count"),
    ("accelerator", "accelerator.memory_per_device_bytes"),
    ("driver", "nvidia.driver_version"),
    ("driver", "nvidia.cuda_driver_version"),
    ("driver", "amd.driver_version"),
    ("CUDA/ROCm", "accelerator.runtime"),
    ("CUDA/ROCm", "accelerator.runtime_version"),
    ("CUDA/ROCm", "framework.cuda_version"),
    ("CUDA/ROCm", "framework.hip_version"),
    ("framework", "framework.name"),
    ("framework", "framework.version"),
    ("framework", "framework.git_version"),
    ("framework", "framework.cudnn_version"),
    ("framework", "framework.nccl_version"),
    ("framework", "framework.miopen_version"),
    ("framework", "framework.rccl_version"),
    ("framework", "framework.loaded.*"),
    ("python", "python.implementation"),
    ("python", "python.version"),
    ("code", "code.remote_url"),
    ("code", "code.branch"),
    ("code", "code.commit"),
    ("code", "code.tree_hash"),
    ("code", "code.dirty"),
    ("image", "container.image_ref"),
    ("image", "container.image_id"),
    ("image", "container.labels.*"),
    ("host", "host.os"),
    ("host", "host.kernel"),
    ("host", "host.cpu_model"),
    ("host", "host.cpu_count"),
    ("host", "host.memory_total_bytes"),
    ("environment", "environment.variables.*"),
    ("run definition", "trial.run.*"),
)
DEVICE_FIELDS = {
    "nvidia": ("name", "compute_capability", "memory_total_bytes", "vbios_version", "ecc_enabled", "mig_enabled",
               "power_limit_w", "visible"),
    "amd": ("market_name", "gfx_target", "vram_total_bytes", "vbios_version", "visible"),
}
ARTIFACT_FIELDS = ("revision", "commit", "content_hash")

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
HIGH_CV = 0.05
"""A run whose step-time CV is above this is called out as noisy."""


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

    def to_json(self) -> dict[str, Any]:
        def side(s: Side) -> dict[str, Any]:
            return {"path": s.path, "signature": asdict(s.signature), "summary": s.summary.to_json()}
        return {
            "a": side(self.a), "b": side(self.b),
            "stack": [asdict(c) for c in self.stack],
            "packages": {
                "added": [{"name": n, "version": v} for n, v in self.packages.added],
                "removed": [{"name": n, "version": v} for n, v in self.packages.removed],
                "changed": [{"name": n, "a": x, "b": y} for n, x, y in self.packages.changed],
            },
            "figures": [asdict(f) for f in self.figures],
        }


def _table_items(data: Mapping[str, Any], dotted: str) -> dict[str, Any]:
    if not dotted.endswith(".*"):
        return {dotted: dig(data, dotted)}
    base = dotted[:-2]
    table = dig(data, base)
    if not isinstance(table, Mapping):
        return {}
    return {f"{base}.{k}": v for k, v in table.items() if not isinstance(v, Mapping)}


def _skipped(data: Mapping[str, Any], dotted: str) -> bool:
    table = dig(data, dotted.split(".")[0])
    return isinstance(table, Mapping) and set(table) == {"skipped"}


def stack_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Change]:
    out: list[Change] = []
    for group, dotted in STACK_FIELDS:
        if _skipped(a, dotted) and _skipped(b, dotted):
            continue
        ia, ib = _table_items(a, dotted), _table_items(b, dotted)
        for key in sorted(set(ia) | set(ib)):
            va, vb = ia.get(key), ib.get(key)
            if va != vb:
                out.append(Change(group, key, va, vb))
    for vendor, fields in DEVICE_FIELDS.items():
        da = {d.get("index", i): d for i, d in enumerate(dig(a, f"{vendor}.devices") or ()) if isinstance(d, Mapping)}
        db = {d.get("index", i): d for i, d in enumerate(dig(b, f"{vendor}.devices") or ()) if isinstance(d, Mapping)}
        for idx in sorted(set(da) | set(db), key=str):
            for f in fields:
                va, vb = (da.get(idx) or {}).get(f), (db.get(idx) or {}).get(f)
                if va != vb:
                    out.append(Change("accelerator", f"{vendor}.devices[{idx}].{f}", va, vb))
    for section in ("models", "datasets"):
        ma, mb = _artifacts(a, section), _artifacts(b, section)
        for name in sorted(set(ma) | set(mb)):
            if name not in ma or name not in mb:
                out.append(Change(section, f"{section}[{name}]",
                                  _artifact_ref(ma.get(name)), _artifact_ref(mb.get(name))))
                continue
            for f in ARTIFACT_FIELDS:
                va, vb = ma[name].get(f), mb[name].get(f)
                if va != vb:
                    out.append(Change(section, f"{section}[{name}].{f}", va, vb))
    return out


def _artifacts(data: Mapping[str, Any], section: str) -> dict[str, Mapping[str, Any]]:
    out = {}
    for item in data.get(section) or ():
        if isinstance(item, Mapping) and set(item) != {"skipped"}:
            out[str(item.get("repo_id") or item.get("spec") or item.get("path"))] = item
    return out


def _artifact_ref(item: Mapping[str, Any] | None) -> str | None:
    if item is None:
        return None
    return str(item.get("commit") or item.get("revision") or item.get("content_hash") or "present")


def _package_version(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return str(entry)
    v = str(entry.get("version", "?"))
    if entry.get("commit"):
        v += f" ({entry.get('source', 'vcs')} {str(entry['commit'])[:12]})"
    return v


def package_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> PackageChanges:
    pa = dig(a, "python.packages") if isinstance(dig(a, "python.packages"), Mapping) else {}
    pb = dig(b, "python.packages") if isinstance(dig(b, "python.packages"), Mapping) else {}
    added = tuple((n, _package_version(pb[n])) for n in sorted(set(pb) - set(pa)))
    removed = tuple((n, _package_version(pa[n])) for n in sorted(set(pa) - set(pb)))
    changed = tuple((n, _package_version(pa[n]), _package_version(pb[n])) for n in sorted(set(pa) & set(pb))
                    if _package_version(pa[n]) != _package_version(pb[n]))
    return PackageChanges(added, removed, changed)


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
    raw = read_bytes(path)
    body, _ = split_signed(raw)
    data = parse_body(body, path)  # trust is not required here; the header reports it
    status = signature_status(raw, path, allowed_signers)
    return Side(path, summarize(data, raw, path, status.principal, status.fingerprint), status), data


def compare_files(a: str, b: str, allowed_signers: str | os.PathLike[str] | None = None) -> Comparison:
    side_a, da = _load(a, allowed_signers)
    side_b, db = _load(b, allowed_signers)
    return Comparison(side_a, side_b, tuple(stack_changes(da, db)), package_changes(da, db),
                      tuple(figure_changes(side_a.summary, side_b.summary)))


def _value(v: Any, unit: str = "") -> str:
    if v is None:
        return "(absent)"
    if unit == "bytes" and isinstance(v, (int, float)):
        return bytes_str(v)
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return number_str(v) + (f" {unit}" if unit else "")
    return str(v)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(c: Comparison) -> str:
    lines = []
    for name, s in (("A", c.a), ("B", c.b)):
        sm = s.summary
        lines.append(f"{name}: {s.path} ({sm.kind}, {sm.accelerator}, created {sm.created_utc}, id {sm.content_id})")
        lines.append(f"   {s.signature.label}")
    lines.append("")
    n = len(c.stack) + (1 if c.packages else 0)
    if n == 0:
        lines.append("Stack: same (no difference in accelerator, driver, CUDA/ROCm, framework, packages, code, "
                     "models, datasets, image, host, run definition)")
    else:
        lines.append("Stack: what changed from A to B")
        rows = [[ch.group, ch.field, _value(ch.a), "->", _value(ch.b)] for ch in c.stack]
        if rows:
            lines.extend(_table(rows))
        p = c.packages
        if p:
            lines.append(f"  packages: {len(p.changed)} changed, {len(p.added)} added, {len(p.removed)} removed")
            prow = [[n, a, "->", b] for n, a, b in p.changed]
            prow += [[n, "(absent)", "->", v] for n, v in p.added]
            prow += [[n, v, "->", "(absent)"] for n, v in p.removed]
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
    return "\n".join(lines)

"""`capture compare` for a terminal: every line fits the terminal's width.

Order: the two files and their signatures; the trial figures (the three cost figures among them);
what each `capture exec` command did; the stack, summarised: the components that matter (torch,
CUDA/ROCm, driver, cuDNN, NCCL), counts of the packages changed, added and removed and the ones
that matter among them, then the other differing fields with long values cut (``…``) and a hint to
``--all`` (every difference, values wrapped whole) and ``--json``; last, the preflight checks.
"""

from __future__ import annotations

import re
from typing import Any

from capture import costs
from capture._escape import printable
from capture.fmt import bytes_str, number_str, percent_str, seconds_str
from capture.results.compare import NOISE_RULE, RUN_DEFINITION, Comparison, FigureChange
from capture.results.summary import RunSummary
from capture.termtable import Column, cut, fit, wrap
from capture.trial.report.checks import HIGH_CV

SHOWN_FIELDS = 8
"""Stack fields listed by default besides the run definition; ``--all`` lists every one."""
SHOWN_RUN_DEFINITION = 12
"""Run-definition fields listed by default, first."""
KEY_PACKAGES = re.compile(r"^(torch|torchvision|triton|pytorch-triton.*|jax|jaxlib|nvidia-(cudnn|nccl|cuda-runtime|cublas)"
                          r".*|cuda-toolkit|transformers|peft|accelerate|deepspeed|flash-attn|bitsandbytes|vllm)$")
"""Packages named under the counts: the framework, its GPU libraries and the training libraries."""


def _value(v: Any, unit: str = "", currency: str | None = None) -> str:
    if v is None:
        return "(absent)"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        if unit == "bytes":
            return bytes_str(v)
        if unit == "s":
            return seconds_str(v)
        if unit == "fraction":
            return percent_str(v)
        if unit == "money":
            return costs.money_str(v, currency)
        return number_str(v) + (f" {unit}" if unit else "")
    return printable(v)


def _figure_row(f: FigureChange, shared_why: bool = False) -> list[str]:
    a = _value(f.a, f.unit, f.basis_a)
    b = _value(f.b, f.unit, f.basis_b)
    if f.name == "peak_memory_bytes":
        a += f" ({f.basis_a})" if f.basis_a and f.a is not None else ""
        b += f" ({f.basis_b})" if f.basis_b and f.b is not None else ""
    rel = f"{f.relative_change:+.1%}" if f.relative_change is not None and not f.why else ""
    verdict = f"{f.verdict}: {f.why}" if f.why and not shared_why else f.verdict
    return [f.label, a, b, rel, verdict]


def _components(s: RunSummary) -> dict[str, str | None]:
    runtime = f"{s.runtime} {s.runtime_version}".strip() if s.runtime and s.runtime != "cpu" else s.runtime
    return {"accelerator": s.accelerator, "driver": s.driver_version, "CUDA/ROCm": runtime, "torch": s.torch_version,
            "cuDNN": s.cudnn_version, "NCCL/RCCL": s.nccl_version}


def render(c: Comparison, width: int | None = None, everything: bool = False) -> str:
    from capture.trial.report.terminal import terminal_width

    width = width or terminal_width()
    out: list[str] = []

    def para(text: str, indent: str = "", sub: str | None = None) -> None:
        out.extend(wrap(printable(text), width, indent, indent + "  " if sub is None else sub))

    for name, s in (("A", c.a), ("B", c.b)):
        sm = s.summary
        para(f"{name}: {s.path}")
        para(f"{sm.kind}, {sm.accelerator}, created {sm.created_utc}, id {sm.content_id}", "   ", "     ")
        para(s.signature.label, "   ", "     ")
    out.append("")
    _figures(c, width, out, para)
    _exec(c, out, para)
    _stack(c, width, everything, out, para)
    if c.preflight:
        out += ["", "Preflight (B relative to A)"]
        rows = [[printable(str(r["name"])) + ("" if r["device"] is None else f" (device {r['device']})"),
                 _value(r["a"], r["unit"] or ""), _value(r["b"], r["unit"] or ""),
                 f"x{r['ratio']:.2f}" if r["ratio"] is not None else "",
                 f"{r['verdict_a'] or '-'} -> {r['verdict_b'] or '-'}"] for r in c.preflight]
        out += fit([Column("check"), Column("A"), Column("B"), Column("B / A", nowrap=True), Column("verdict")],
                   rows, width, indent=2).lines
    return "\n".join(line.rstrip() for line in out)


def _figures(c: Comparison, width: int, out: list[str], para: Any) -> None:
    if not c.figures:
        out.append("Trial figures: none in either manifest (fingerprints only)")
        return
    out.append("Trial figures (B relative to A)")
    whys = [f.why for f in c.figures if f.why]
    shared = {w for w in whys if whys.count(w) > 1}  # said once under the table, not in every row
    rows = [_figure_row(f, f.why in shared) for f in c.figures]
    out += fit([Column("figure", min_width=14), Column("A", min_width=12), Column("B", min_width=12),
                Column("change", nowrap=True), Column("verdict", min_width=12)], rows, width, indent=2).lines
    for why in sorted(shared):
        names = ", ".join(f.label for f in c.figures if f.why == why)
        para(f"not comparable ({names}): {why}", "  ")
    targets = {s.summary.costs.target.text() for s in (c.a, c.b) if s.summary.costs is not None}
    if targets:
        para(f"projected to {' / '.join(sorted(targets))}; each at its own recorded price (docs/decide.md)", "  ")
    cvs = [(n, s.summary.figures.step_time_cv) for n, s in (("A", c.a), ("B", c.b))]
    para("step-time CV: " + ", ".join(f"{n} {cv * 100:.2f} %" if cv is not None else f"{n} not measured"
                                       for n, cv in cvs) + f"; {NOISE_RULE}", "  ")
    for n, cv in cvs:
        if cv is not None and cv > HIGH_CV:
            para(f"{n}: step-time CV {cv * 100:.1f} % is high (above {HIGH_CV * 100:.0f} %): its throughput "
                 "figures are noisy", "  ")


def _exec(c: Comparison, out: list[str], para: Any) -> None:
    records = [(n, s.summary.exec) for n, s in (("A", c.a), ("B", c.b)) if s.summary.exec is not None]
    if not records:
        return
    out += ["", "Commands (capture exec)"]
    for n, e in records:
        para(f"{n}: {e.line()}; outputs: {e.outputs_text()}", "  ", "     ")


def _stack(c: Comparison, width: int, everything: bool, out: list[str], para: Any) -> None:
    out.append("")
    p = c.packages
    if not c.stack and not p:
        para("Stack: same (no difference in accelerator, driver, CUDA/ROCm, framework, packages, code, "
             "models, datasets, image, host, run definition)")
        return
    out.append("Stack: what changed from A to B")
    ca, cb = _components(c.a.summary), _components(c.b.summary)
    rows = [[k, printable(ca[k] or "-"), printable(cb[k] or "-"), "same" if ca[k] == cb[k] else "changed"]
            for k in ca if ca[k] or cb[k]]
    out += fit([Column("component"), Column("A"), Column("B"), Column("", nowrap=True)], rows, width, indent=2).lines
    if p:
        para(f"packages: {len(p.changed)} changed, {len(p.added)} added, {len(p.removed)} removed", "  ")
        prow = [[n, a, b] for n, a, b in p.changed] + [[n, "(absent)", v] for n, v in p.added] \
            + [[n, v, "(absent)"] for n, v in p.removed]
        shown = prow if everything else [r for r in prow if KEY_PACKAGES.match(r[0])]
        if shown:
            if not everything:
                para("that matter:", "  ")
            out += _pairs(shown, width, everything)
    fields = [[ch.group, ch.field, _plain(ch.a), _plain(ch.b)] for ch in c.stack]
    details = [(ch.field, ch.detail) for ch in c.stack if ch.detail]
    if fields:
        groups: dict[str, int] = {}
        for g, *_ in fields:
            groups[g] = groups.get(g, 0) + 1
        para(f"other fields: {len(fields)} differ (" + ", ".join(f"{g} {n}" for g, n in groups.items()) + ")", "  ")
        # The run definition first (it is why trial figures are not comparable), a changed value
        # before a key only one side has.
        run_def = sorted((f for f in fields if f[0] == RUN_DEFINITION), key=lambda f: "(absent)" in (f[2], f[3]))
        rest = [f for f in fields if f[0] != RUN_DEFINITION]
        rows = fields if everything else run_def[:SHOWN_RUN_DEFINITION] + rest[:SHOWN_FIELDS]
        out += _pairs([[f, a, b] for _, f, a, b in rows], width, everything)
        for field, detail in details if everything else details[:2]:
            para(f"{field}: {detail}", "    ", "      ")
    if not everything:
        para("`capture compare --all` lists every difference with its whole value; --json for programs", "  ")


def _plain(v: Any) -> str:
    return "(absent)" if v is None else printable(v if isinstance(v, str) else str(v))


def _pairs(rows: list[list[str]], width: int, everything: bool) -> list[str]:
    """``name  A -> B`` rows: whole values wrapped (``--all``), else each cut to its share of the line."""
    if everything:
        out: list[str] = []
        for name, a, b in rows:
            out += wrap(f"{name}: {a} -> {b}", width, "    ", "      ")
        return out
    name_w = min(max(len(r[0]) for r in rows), max(16, width // 3))
    value_w = max(8, (width - 4 - name_w - 2 - 4) // 2)
    return [f"    {cut(r[0], name_w, keep_end=True):<{name_w}}  {cut(r[1], value_w):<{value_w}} -> {cut(r[2], value_w)}".rstrip()
            for r in rows]

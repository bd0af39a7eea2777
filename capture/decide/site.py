"""The decision as a static site: ``index.html`` (ranked table and plots per group, the trust of
every file, drift within each group) and ``runs/<content id>.html`` (each run's trial report).

Self-contained: inline CSS and SVG, no scripts, no fonts or files from elsewhere, so it works
offline from ``file://``; the Content-Security-Policy of every page forbids any fetch. Every string
from a manifest is escaped.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any, Sequence, cast

from capture._atomic import atomic_write
from capture.decide.rank import Group
from capture.decide.runs import FileStatus, Run
from capture import costs
from capture.decide import text
from capture.decide.text import COLUMNS, row
from capture.fmt import bytes_str, number_str, seconds_str
from capture.trial.report import page, report_body
from capture.trial.report.html import nice_ticks, td

FIGURE_COLUMNS = frozenset(i for i, h in enumerate(COLUMNS)
                           if h not in ("configuration", "recovery", "preflight", "notes"))
"""Cells that stay on one line on the site (figures with their unit, ids)."""
MONEY_COLUMNS = ("price/device-h", "trial cost", "steady cost / M tokens", "cost to target")
_COLOURS = {"single": "#4e79a7", "ddp": "#f28e2b", "fsdp": "#59a14f"}
_SIG_LABEL = {"ok": "signature valid, signer trusted", "unsigned": "NOT signed", "invalid": "signature INVALID",
              "untrusted": "signature valid, signer NOT trusted", "malformed": "malformed", "error": "error"}


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def signature_label(f: FileStatus) -> str:
    who = f" by {f.principal}" if f.principal else ""
    why = f": {f.reason}" if f.reason and f.state != "ok" else ""
    return _SIG_LABEL.get(f.state, f.state) + who + why


LABEL_CHAR_PX = 7.5
"""A generous average glyph width of the page's font at the charts' size, for fitting labels."""


def _fit(label: str, chars: int) -> str:
    """``label`` within ``chars`` characters: a long device name is shortened in its middle (its
    start and the run id at the end stay); the whole label stays in the bar's tooltip."""
    if len(label) <= chars:
        return label
    head, sep, tail = label.partition(" · ")
    tail = sep + tail
    room = chars - len(tail) - 1
    if room < 12:
        return label[: chars - 1] + "…"
    return head[: room - room // 3] + "…" + head[len(head) - room // 3:] + tail


def bar_chart(title: str, bars: list[tuple[str, float, str, str]], fmt: Any,
              limit: Sequence[tuple[str, float]] = ()) -> str:
    """Horizontal bars (label, value, colour, value text) with an axis; ``limit``: dashed lines
    (e.g. a card's memory capacity). Each label stands on its own line above its bar, so a long
    device name is never clipped."""
    if not bars:
        return ""
    w, left, right, label_h, bar_h, gap, top = 760, 20, 110, 14, 16, 8, 30  # left: room for the axis's first tick
    vmax = max([v for _, v, _, _ in bars] + [v for _, v in limit]) * 1.08 or 1.0
    pw = w - left - right
    step = label_h + bar_h + gap
    h = top + len(bars) * step + 20 + 14 * len(limit)
    x = lambda v: left + pw * v / vmax  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
           f'aria-label="{_e(title)}"><text x="4" y="14" font-weight="bold">{_e(title)}</text>']
    base = top + len(bars) * step
    div, unit = axis_unit(fmt, vmax)
    for t in (tick * div for tick in nice_ticks(vmax / div)):
        if t <= vmax:
            out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top - 4}" y2="{base - gap}" stroke="#e4e6ea"/>'
                       f'<text x="{x(t):.1f}" y="{base + 6}" text-anchor="middle" fill="#667">{_e(unit(t))}</text>')
    for i, (label, v, colour, text) in enumerate(bars):
        y = top + i * step
        out.append(f'<text x="{left}" y="{y + label_h - 3}">{_e(_fit(label, int((w - left - 4) / LABEL_CHAR_PX)))}</text>'
                   f'<rect x="{left}" y="{y + label_h}" width="{max(x(v) - left, 0.5):.1f}" height="{bar_h}" '
                   f'fill="{colour}"><title>{_e(label)}: {_e(text)}</title></rect>'
                   f'<text x="{x(v) + 4:.1f}" y="{y + label_h + bar_h * 0.75:.1f}">{_e(text)}</text>')
    for i, (name, v) in enumerate(limit):
        text = f"{name} {bytes_str(v)}"
        # under its dashed line, ending there; from the left edge when it would not fit before the line
        at = (f'x="{x(v) - 3:.1f}" text-anchor="end"' if len(text) * 6.5 < x(v) - 3 - left
              else f'x="{left}" text-anchor="start"')
        out.append(f'<line x1="{x(v):.1f}" x2="{x(v):.1f}" y1="{top - 6}" y2="{base}" stroke="#a4161a" stroke-dasharray="4,3"/>'
                   f'<text {at} y="{base + 20 + 14 * i}" fill="#a4161a">{_e(text)}</text>')
    out.append("</svg>")
    return "".join(out)


def axis_unit(fmt: Any, vmax: float) -> tuple[float, Any]:
    """Round ticks in the unit people read: hours, minutes or seconds; GiB or MiB; else plain."""
    if fmt is seconds_str:
        for div, name in ((3600, "h"), (60, "min"), (1, "s")):
            if vmax >= 2 * div or div == 1:
                return div, lambda t, d=div, n=name: f"{t / d:g} {n}"
    if fmt is bytes_str:
        for div, name in ((2**30, "GiB"), (2**20, "MiB"), (1, "B")):
            if vmax >= div or div == 1:
                return div, lambda t, d=div, n=name: f"{t / d:g} {n}"
    return 1, fmt


def group_plots(g: Group) -> str:
    cs = [c for c in g.configs if c.tokens_per_s]
    if not cs:
        return ""
    label = lambda c: f"{c.label} · run {c.run_id}" + ("" if c.trusted else " (untrusted)")  # noqa: E731
    colour = lambda c: _COLOURS.get(c.strategy, "#6b7785") if c.trusted else "#bbb"  # noqa: E731
    parts = []  # below, cast: the lists were filtered on the figure each bar shows
    costed = [c for c in cs if c.cost_to_target is not None]
    if costed:
        cur = costed[0].cost.currency
        parts.append(bar_chart(f"projected cost to the target ({cur})", [
            (label(c), cast(float, c.cost_to_target), colour(c), c.cost.money(c.cost_to_target)) for c in costed],
            costs.money_str))
    timed = [c for c in cs if c.time_to_target_s is not None]
    if timed:
        parts.append(bar_chart(f"projected time to the target ({timed[0].target.text()})", [
            (label(c), cast(float, c.time_to_target_s), colour(c), seconds_str(c.time_to_target_s)) for c in timed],
            seconds_str))
    parts.append(bar_chart("measured tokens/s", [
        (label(c), cast(float, c.tokens_per_s), colour(c), number_str(c.tokens_per_s)) for c in cs], number_str))
    mem = [c for c in cs if c.peak_memory_bytes]
    caps = sorted({(c.card, c.memory_per_device_bytes) for c in mem if c.memory_per_device_bytes}, key=lambda t: t[1])
    if mem:
        parts.append(bar_chart("peak memory per device against the card's capacity", [
            (label(c), cast(float, c.peak_memory_bytes), colour(c), bytes_str(c.peak_memory_bytes)) for c in mem],
            bytes_str,
            [(f"{n} capacity", v) for n, v in caps]))
    return "".join(parts)


def _table(headers: list[str], rows: list[list[str]], classes: list[str] | None = None,
           links: dict[int, list[str | None]] | None = None, figures: frozenset[int] = frozenset()) -> str:
    """A table that wraps to the page: text cells wrap at spaces (a long hash or path anywhere);
    cells in ``figures`` (a number with its unit, an id) stay on one line."""
    out = ['<table class="ranked"><tr>' + "".join(f"<th>{_e(h).replace('/', '/<wbr>')}</th>" for h in headers) + "</tr>"]
    for i, r in enumerate(rows):
        row_cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = []
        for j, c in enumerate(r):
            href = (links or {}).get(j, [None] * len(rows))[i]
            cell = td(c, "fig" if j in figures else "")
            cells.append(cell.replace(f">{_e(c)}</td>", f'><a href="{_e(href)}">{_e(c)}</a></td>', 1) if href else cell)
        out.append(f"<tr{row_cls}>" + "".join(cells) + "</tr>")
    return "".join(out) + "</table>"


def _absent(v: Any) -> Any:
    return "(absent)" if v is None else v


def _drift(g: Group) -> str:
    from capture.results.compare import RUN_DEFINITION, package_changes, stack_changes

    if len(g.runs) < 2:
        return "<p class=\"muted\">one run in this group: nothing to compare</p>"
    base = g.runs[0]
    items = []
    for r in g.runs[1:]:
        changes = [c for c in stack_changes(base.data, r.data) if c.group != RUN_DEFINITION]
        pk = package_changes(base.data, r.data)
        if not changes and not pk:
            items.append(f"<li>{_e(r.slug)}: same stack as {_e(base.slug)}</li>")
            continue
        shown = "".join(f"<li><code>{_e(c.field)}</code>: {_e(_absent(c.a))} → {_e(_absent(c.b))}</li>" for c in changes[:12])
        more = f"<li>… {len(changes) - 12} more</li>" if len(changes) > 12 else ""
        pkg = (f"<li>packages: {len(pk.changed)} changed, {len(pk.added)} added, {len(pk.removed)} removed</li>"
               if pk else "")
        items.append(f"<li>{_e(r.slug)} against {_e(base.slug)}: {len(changes)} stack field(s) differ"
                     f"<ul>{shown}{more}{pkg}</ul></li>")
    return "<ul>" + "".join(items) + "</ul>"


def index_html(groups: list[Group], files: list[FileStatus], run_pages: dict[str, str],
               currency: str | None = None) -> str:
    currency = currency or next((c.cost.currency for g in groups for c in g.configs), costs.default_currency())
    header = text.target_lines(groups, currency)
    body = ["<h1>Which card, how many, for how long</h1>",
            f'<p class="muted">{_e(header[0])} Ranked by projected cost to the target (#cost), then by '
            "projected time to the target (#time), from each run's own measured figures. Runs with different run "
            "definitions are never ranked against each other; unsigned, tampered or untrusted runs are shown in red "
            "and never ranked. Untested cards get no speed figures, only a memory estimate.</p>",
            f'<p class="muted">{_e(header[1])}</p>']
    answers = [text.headline(i, g).split(": ", 1) for i, g in enumerate(groups, 1)]
    body.append('<h2 id="answer">The answer</h2><ul class="answer">'
                + "".join(f'<li><a href="#group-{i}"><b>{_e(head)}</b></a>: {_e(rest)}</li>'
                          for i, (head, rest) in enumerate(answers, 1))
                + ("" if groups else f"<li>{_e(text.nothing_ranked(files))}</li>") + "</ul>")
    body.append("<nav>" + "".join(f'<a href="#group-{i}">group {i}</a>' for i in range(1, len(groups) + 1))
                + '<a href="#files">files and trust</a></nav>')
    for i, g in enumerate(groups, 1):
        body.append(f'<h2 id="group-{i}">Group {i}: {_e(g.definition.label())}</h2>')
        if g.left_out_reason:
            body.append(f'<p class="status warn">{_e(g.left_out_reason)}</p>')
        if g.configs:
            rows = [row(c) for c in g.configs]
            classes = ["" if c.trusted else "untrusted" for c in g.configs]
            links: dict[int, list[str | None]] = {2: [run_pages.get(c.run.path) for c in g.configs],
                                                  3: [run_pages.get(c.run.path) for c in g.configs]}
            heads = [f"{h} ({currency})" if h in MONEY_COLUMNS else h for h in COLUMNS]
            body.append(_table(heads, rows, classes, links, FIGURE_COLUMNS))
            prices = sorted({f"{c.card}: {c.price.per_device_hour:g} {c.price.currency} per device-hour, "
                             f"{c.price.source}" for c in g.configs if c.price})
            if prices:
                body.append(f'<p class="muted">prices: {_e("; ".join(prices))}</p>')
            body.append(group_plots(g))
        if g.untested:
            body.append("<h3>Untested cards (memory only, estimate)</h3>")
            body.append(_table(["card", "memory", "fits in memory (estimate)", "basis"],
                               [[u.name, bytes_str(u.memory_bytes),
                                 "yes" if u.fits else "no" if u.fits is False else "unknown", u.basis] for u in g.untested]))
        body.append("<h3>Drift between runs of this group</h3>" + _drift(g))
    body.append('<h2 id="files">Files: signature and trust</h2>')
    body.append(_table(["status", "file", "signature", "kind", "note"],
                       [[f.state.upper(), f.path, signature_label(f), f.kind or "-", f.note or ""] for f in files],
                       ["" if f.trusted else "untrusted" for f in files],
                       {1: [run_pages.get(f.path) for f in files]}))
    return page("capture decide", "\n".join(body)).replace("<body>", '<body class="site">', 1)


def write_site(out_dir: str | os.PathLike[str], groups: list[Group], files: list[FileStatus], runs: list[Run],
               currency: str | None = None) -> Path:
    """Write the site; nothing half-written: every page is written atomically, index last."""
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    by_path = {f.path: f for f in files}
    figures = {c.run.path: c.cost for g in groups for c in g.configs if c.strategy == "single"}
    run_pages: dict[str, str] = {}
    for r in runs:
        name = f"runs/{r.slug}.html"
        sig = signature_label(by_path[r.path])
        body = (f'<nav><a href="../index.html">← all runs</a></nav>'
                f'<p class="muted">{_e(r.path)}</p>' + report_body(r.data, sig, figures.get(r.path)))
        atomic_write(out / name, page(f"run {r.slug}", body).encode("utf-8"))
        run_pages[r.path] = name
    atomic_write(out / "index.html", index_html(groups, files, run_pages, currency).encode("utf-8"))
    return out / "index.html"


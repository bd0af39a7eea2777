"""The report as one self-contained HTML page: inline CSS and SVG, no scripts, no external files.

Every string from the manifest is escaped (``html.escape``); the plots are SVG written here, with
axis ticks, so the page reads the same offline from ``file://``. :func:`page` and :data:`CSS` are
shared with the decision site (``capture.decide.site``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capture._atomic import atomic_write
from capture.fmt import bytes_str, seconds_str
from capture.manifest import dig
from capture.trial.report.checks import verdict_panel
from capture.trial.report.layout import sections
from capture.trial.report.sections import (_card_capacity, _estimate_total, estimate_terms, fit_cards, measured_bars,
                                           step_stats, step_times, title)
from capture.trial.report.terminal import status_state
from capture.trial.report.values import _first, _is_num, _table

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:64em;color:#1d232a;padding:0 1em}
td,li,p,code,.panel div{overflow-wrap:break-word}.panel div{min-width:0}.long,.panel div{overflow-wrap:anywhere}
td.fig{white-space:nowrap}
h1{font-size:1.4em}h2{font-size:1.1em;margin:1.6em 0 .3em;border-bottom:1px solid #ccd}
p.status{margin:.2em 0 .6em;font-weight:600}.ok{color:#17692d}.bad{color:#a4161a}.none{color:#778}
table{border-collapse:collapse;margin:.4em 0}td,th{padding:.15em .9em .15em 0;text-align:left;vertical-align:top}
th{font-weight:600;border-bottom:1px solid #ccd}td.k{color:#556}code{font-size:.95em}
td.i1{padding-left:1.2em}td.i2{padding-left:2.4em}td.i3{padding-left:3.6em}
svg{display:block;margin:.5em 0;max-width:100%;height:auto}svg text{font:11px system-ui,sans-serif;fill:#333}
.panel{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1.2em;background:#f4f6f8;border:1px solid #ccd;
border-radius:6px;padding:.8em 1em;margin:1em 0}.panel .k{color:#556;font-weight:600}.warn{color:#8a5a00}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}tr.untrusted td{color:#a4161a}
nav a{margin-right:1em}.muted{color:#667}body.site{max-width:100em}ul.answer li{margin:.3em 0}
table.ranked{font-size:13px}table.ranked td,table.ranked th{padding:.2em .5em .2em 0}table.ranked tr:nth-child(even){background:#f7f8fa}
"""
CSS = _CSS

_TERM_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _status_class(status: str) -> str:
    return status_state(status)


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round axis ticks from 0 to ``top``: about ``count`` steps of 1, 2, 2.5 or 5 times a power of ten
    (the trial report's charts and decide's page)."""
    if top <= 0:
        return [0.0]
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    return [i * step for i in range(int(top / step) + 1)]


def step_time_svg(m: Mapping[str, Any]) -> str:
    """Per-step times as points and a line; warm-up steps greyed and left out of median and p90."""
    times, warm = step_times(m)
    if not times:
        return ""
    s = step_stats(m)
    w, h, left, right, top, bottom = 720, 260, 64, 16, 16, 36
    pw, ph = w - left - right, h - top - bottom
    # Scale to the measured steps: a slow first step must not flatten the ones that count.
    ymax = (max(times[warm:]) if warm < len(times) else max(times)) * 1.25 or 1.0
    ticks = nice_ticks(ymax)
    ymax = max(ymax, ticks[-1])
    x = lambda i: left + (pw * (i + 0.5) / len(times))  # noqa: E731
    y = lambda v: top + ph - ph * v / ymax  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
             f'role="img" aria-label="step time per step">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafbfc" stroke="#ccd"/>']
    for t in ticks:
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#e4e6ea"/>'
                     f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{_e(seconds_str(t))}</text>')
    if warm:
        parts.append(f'<rect x="{left}" y="{top}" width="{x(warm - 1) - left + pw / len(times) / 2:.1f}" height="{ph}" '
                     f'fill="#eee"/><text x="{left + 4}" y="{top + ph - 6}">warm-up (excluded)</text>')
    pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(times) if i >= warm)
    if pts:
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#4e79a7" stroke-width="1.5"/>')
    for i, v in enumerate(times):
        fill = "#aab" if i < warm else "#4e79a7"
        tip = f"<title>step {i + 1}: {_e(seconds_str(v))}</title>"
        if v > ymax:  # off the scale (a warm-up step): a triangle at the top edge
            parts.append(f'<path d="M{x(i) - 4:.1f},{top + 7} L{x(i) + 4:.1f},{top + 7} L{x(i):.1f},{top + 1} Z" '
                         f'fill="{fill}">{tip}</path>')
        else:
            parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.5" fill="{fill}">{tip}</circle>')
    for key, colour, dash, anchor, lx in (("median", "#17692d", "", "start", left + 4),
                                          ("p90", "#a4161a", ' stroke-dasharray="5,4"', "end", left + pw - 4)):
        if key in s:
            yy = y(s[key])
            parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{colour}"{dash}/>'
                         f'<text x="{lx}" y="{yy - 4:.1f}" text-anchor="{anchor}" fill="{colour}">'
                         f'{key} {_e(seconds_str(s[key]))}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{h - 6}" text-anchor="middle">step (1 … {len(times)})</text></svg>')
    return "".join(parts)


def memory_svg(m: Mapping[str, Any]) -> str:
    """Estimate terms stacked, then the measured peaks, against the cards' capacities.

    A capacity more than 4x the largest bar would squash the bars to slivers, so it is named
    in an "off scale" line instead of drawn.
    """
    est = _table(m, "trial.memory.estimate")
    meas = _table(m, "trial.memory.measured") or {}
    terms = estimate_terms(est)
    total = _estimate_total(est)
    if terms and total is not None and total > sum(v for _, v in terms) * 1.001:
        terms.append(("other (in total)", total - sum(v for _, v in terms)))
    bars: list[tuple[str, list[tuple[str, float]]]] = []
    if terms:
        bars.append(("estimate", terms))
    elif total is not None:
        bars.append(("estimate", [("total", total)]))
    bars += [(label, [(label, v)]) for label, v in measured_bars(meas)]
    if not bars:
        return ""
    card_caps = [(str(_first(c, "name", "card", "model") or "?"), _card_capacity(c)) for c in fit_cards(m)]
    dev = dig(m, "accelerator.memory_per_device_bytes")
    if not (_is_num(dev) and dev > 0):
        dev = meas.get("device_total_bytes")
    if _is_num(dev) and dev > 0:
        card_caps.append(("this device", float(dev)))
    merged: dict[float, list[str]] = {}
    for name, cap in card_caps:
        if cap:
            merged.setdefault(cap, []).append(name)
    caps = [(" = ".join(names), cap) for cap, names in sorted(merged.items())]
    largest_bar = max(sum(v for _, v in parts) for _, parts in bars)
    on_scale = [(n, c) for n, c in caps if c <= 4 * largest_bar]
    off_scale = [(n, c) for n, c in caps if c > 4 * largest_bar]
    xmax = max([largest_bar] + [c for _, c in on_scale]) * 1.08 or 1.0
    w, left, right, bar_h, gap, top = 720, 110, 80, 22, 10, 34  # right: room for the bar's value
    pw = w - left - right
    legend_rows = (len(terms) + 1) // 2
    off_lines = [off_scale[i:i + 3] for i in range(0, len(off_scale), 3)]
    h = top + len(bars) * (bar_h + gap) + 12 * max(1, min(3, len(on_scale))) + 40 + 14 * (legend_rows + len(off_lines) + bool(off_lines))
    x = lambda v: left + pw * v / xmax  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
           f'role="img" aria-label="memory: estimate and measured">']
    colour_of = {name: _TERM_COLOURS[i % len(_TERM_COLOURS)] for i, (name, _) in enumerate(terms)}
    for row, (label, segs) in enumerate(bars):
        yy = top + row * (bar_h + gap)
        out.append(f'<text x="{left - 6}" y="{yy + bar_h * 0.7:.1f}" text-anchor="end">{_e(label)}</text>')
        acc = 0.0
        for name, v in segs:
            colour = colour_of.get(name, "#6b7785") if label == "estimate" else "#3b4a5a"
            out.append(f'<rect x="{x(acc):.1f}" y="{yy}" width="{max(x(acc + v) - x(acc), 0.5):.1f}" height="{bar_h}" '
                       f'fill="{colour}"><title>{_e(name)}: {_e(bytes_str(v))}</title></rect>')
            acc += v
        out.append(f'<text x="{x(acc) + 4:.1f}" y="{yy + bar_h * 0.7:.1f}">{_e(bytes_str(acc))}</text>')
    base = top + len(bars) * (bar_h + gap)
    div = 2**30 if xmax >= 2**30 else 2**20 if xmax >= 2**20 else 1
    unit = {2**30: "GiB", 2**20: "MiB", 1: "B"}[div]
    for t in (tick * div for tick in nice_ticks(xmax / div, 6)):  # the axis: a bar's end can be read, not only hovered
        if t <= xmax:
            out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top - 4}" y2="{base - gap}" stroke="#e4e6ea"/>'
                       f'<text x="{x(t):.1f}" y="{top - 8}" text-anchor="middle" fill="#667">{t / div:g} {unit}</text>')
    for i, (name, cap) in enumerate(on_scale):
        out.append(f'<line x1="{x(cap):.1f}" x2="{x(cap):.1f}" y1="{top - 6}" y2="{base}" stroke="#a4161a" '
                   f'stroke-dasharray="4,3"/><text x="{x(cap) - 3:.1f}" y="{base + 12 + 12 * (i % 3)}" '
                   f'text-anchor="end" fill="#a4161a">{_e(name)} {_e(bytes_str(cap))}</text>')
    ly = base + 12 * max(1, min(3, len(on_scale))) + 20
    term_total = sum(v for _, v in terms) or 1.0
    for i, (name, v) in enumerate(terms):  # value and share in the legend: a sliver stays readable
        lx = left + (i % 2) * 300
        yy = ly + 14 * (i // 2)
        out.append(f'<rect x="{lx}" y="{yy - 9}" width="10" height="10" fill="{colour_of[name]}"/>'
                   f'<text x="{lx + 14}" y="{yy}">{_e(name)} {_e(bytes_str(v))} ({v / term_total * 100:.0f} %)</text>')
    if off_lines:
        out.append(f'<text x="{left}" y="{ly + 14 * legend_rows + 4}" fill="#a4161a">capacities off scale '
                   f'(more than 4x the largest bar):</text>')
        for i, chunk in enumerate(off_lines):
            names = ", ".join(f"{n} {bytes_str(c)}" for n, c in chunk)
            out.append(f'<text x="{left + 12}" y="{ly + 14 * (legend_rows + i + 1) + 4}" fill="#a4161a">{_e(names)}</text>')
    out.append("</svg>")
    return "".join(out)


def panel_html(manifest: Mapping[str, Any], signature: str | None = None, cost: Any = None) -> str:
    """The verdict panel: signature, stack, fit and headroom, recovery, tokens/s, MFU, cost."""
    return ('<div class="panel" role="region" aria-label="verdict">'
            + "".join(f'<div class="k">{_e(v.label)}</div><div class="{_e(v.state)}">{_e(v.value)}</div>'
                      for v in verdict_panel(manifest, signature, cost)) + "</div>")


def td(value: Any, cls: str = "") -> str:
    """A cell; one holding a token too long to wrap at a space (a hash, a path) may break anywhere,
    so that no table is wider than the page."""
    text = str(value)
    if any(len(w) > 24 for w in text.split()):
        cls = f"{cls} long".strip()
    return f'<td class="{cls}">{_e(text)}</td>' if cls else f"<td>{_e(text)}</td>"


def _key_class(label: str) -> str:
    """``k``, and ``i1``..``i3`` for a label indented under the row above (two spaces a level in
    the terminal): the page shows the same nesting."""
    level = min((len(label) - len(label.lstrip(" "))) // 2, 3)
    return f"k i{level}" if level else "k"


def grid_html(headers: list[str], rows: list[list[str]]) -> str:
    return ("<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"
            + "".join("<tr>" + "".join(td(c, "fig" if len(str(c)) <= 12 else "") for c in row) + "</tr>"
                      for row in rows) + "</table>")


def report_body(manifest: Mapping[str, Any], signature: str | None = None, cost: Any = None) -> str:
    """The report without the page around it (the decision site wraps it in its own navigation).
    ``cost``: the cost figures to show (the decision's, at its price and target)."""
    body = [f"<h1>{_e(title(manifest))}</h1>", panel_html(manifest, signature, cost)]
    for sec in sections(manifest, cost):
        body.append(f"<h2>{_e(sec.title)}</h2>")
        if sec.status:
            body.append(f'<p class="status {_status_class(sec.status)}">{_e(sec.status)}</p>')
        if sec.title == "Steps":
            body.append(step_time_svg(manifest))
        if sec.title == "Memory":
            body.append(memory_svg(manifest))
        if sec.rows:
            body.append("<table>" + "".join(f'<tr><td class="{_key_class(k)}">{_e(k.strip())}</td>{td(v)}</tr>'
                                            for k, v in sec.rows) + "</table>")
        for grid in sec.grids:
            body.append(grid_html(grid.headers, grid.rows))
    return "\n".join(body)


def page(page_title: str, body: str) -> str:
    """A whole self-contained page; the Content-Security-Policy forbids scripts and any fetch."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{_e(page_title)}</title><style>{CSS}</style></head><body>\n"
            + body + "\n</body></html>\n")


def render_html(manifest: Mapping[str, Any], signature: str | None = None, cost: Any = None) -> str:
    """One self-contained page: inline CSS and SVG, no scripts, no external assets."""
    return page(title(manifest), report_body(manifest, signature, cost))


def write_html(manifest: Mapping[str, Any], path: Path) -> Path:
    """Write the HTML report atomically to ``path`` (by convention next to the manifest)."""
    path = Path(path)
    atomic_write(path, render_html(manifest).encode("utf-8"))
    return path


def html_path_for(manifest_path: Path) -> Path:
    """``results/run.toml`` → ``results/run.html``."""
    return Path(manifest_path).with_suffix(".html")

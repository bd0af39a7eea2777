"""The decision for the terminal and for programs (``--json``)."""

from __future__ import annotations

import io
from typing import Any

from capture.decide.rank import Config, Group
from capture.decide.runs import FileStatus
from capture.fmt import MISSING, bytes_str, number_str, percent_str, seconds_str

COLUMNS = ("#cost", "#time", "configuration", "tokens/s", "efficiency", "peak memory", "headroom", "recovery",
           "preflight", "price/device-h", "cost / M tokens", "time to target", "signature", "notes")


def _money(v: float | None) -> str:
    return MISSING if v is None else f"{v:.4g}"


def row(c: Config) -> list[str]:
    """One configuration as the cells of :data:`COLUMNS` (the site uses the same cells)."""
    notes = list(c.notes)
    if c.within_noise_of_best:
        notes.insert(0, "tokens/s within noise of #1")
    return [
        str(c.rank_cost) if c.rank_cost else "-",
        str(c.rank_time) if c.rank_time else "-",
        c.label,
        number_str(c.tokens_per_s) if c.tokens_per_s is not None else MISSING,
        number_str(c.efficiency) if c.efficiency is not None else MISSING,
        bytes_str(c.peak_memory_bytes),
        percent_str(c.headroom_fraction) if c.headroom_fraction is not None else MISSING,
        c.recovery or "not measured",
        c.preflight or "not run",
        (f"{c.price.per_device_hour:g} ({c.price.source})" if c.price else "no price"),
        _money(c.cost_per_million_tokens),
        seconds_str(c.time_to_target_s),
        c.run.file.state,
        "; ".join(notes),
    ]


def render(groups: list[Group], files: list[FileStatus], width: int | None = None) -> str:
    """Tables wrapped to the terminal's width (rich; manifest strings as plain text, never markup)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from capture.trial.report.terminal import _clean, terminal_width

    buf = io.StringIO()
    con = Console(file=buf, width=width or terminal_width(), no_color=True, color_system=None, highlight=False,
                  markup=False, emoji=False)

    def table(headers: list[str], rows: list[list[str]]) -> Table:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
        for h in headers:  # a header's longest word stays whole; values wrap at spaces, fold only when they must
            t.add_column(Text(h), overflow="fold", min_width=max(len(w) for w in h.split()))
        for r in rows:
            t.add_row(*(Text(_clean(c)) for c in r))
        return t

    con.print("Files")
    con.print(table(["status", "file", "signer or reason", "note"],
                    [[f.state.upper(), f.path, f.principal or f.reason or "", f.note or ""] for f in files]))
    for i, g in enumerate(groups, 1):
        con.print()
        con.print(Text(_clean(f"Group {i}: {g.definition.label()}")))
        if g.left_out_reason:
            con.print(Text(_clean(g.left_out_reason)))
        if g.configs:
            c0 = g.configs[0]
            con.print(Text(f"target: {c0.target_tokens:,} tokens ({_clean(c0.target_source)}); cost = time to target x "
                           "price per device-hour x devices"))
            con.print(table(list(COLUMNS), [row(c) for c in g.configs]))
        fits = [f"{u.name} {'fits' if u.fits else 'does not fit' if u.fits is False else 'unknown'}" for u in g.untested]
        if fits:
            con.print(Text(_clean(f"untested cards (memory only, estimate; no speed figures): {', '.join(fits)}")))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def to_json(groups: list[Group], files: list[FileStatus]) -> dict[str, Any]:
    return {
        "files": [f.to_json() for f in files],
        "groups": [{
            "definition": g.definition.to_json(),
            "left_out_reason": g.left_out_reason,
            "runs": [r.path for r in g.runs],
            "configurations": [c.to_json() for c in g.configs],
            "untested_cards": [{"name": u.name, "memory_bytes": u.memory_bytes, "fits_estimate": u.fits,
                                "basis": u.basis} for u in g.untested],
        } for g in groups],
    }

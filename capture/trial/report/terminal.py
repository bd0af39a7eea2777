"""The report for the terminal: the verdict panel, then every section, wrapped to the terminal's width.

Rendered with ``rich`` (tables that wrap long values instead of cutting them). Every string from
the manifest goes in as plain ``Text`` (never markup) after its control characters are escaped,
so a foreign manifest cannot move the cursor or recolour the terminal.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from capture.trial.report.checks import verdict_panel
from capture.trial.report.layout import sections
from capture.trial.report.sections import title
from capture.trial.report.values import NOT_MEASURED

_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09,)}
LABEL_WIDTH = 12
_STYLES = {"ok": "green", "bad": "bold red", "warn": "yellow", "none": "dim", "": ""}


def _clean(text: Any) -> str:
    """Neutralise control characters (escape sequences in a foreign manifest must not reach the TTY)."""
    return str(text).translate(_CONTROL)


def _use_colour(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def terminal_width() -> int:
    """The terminal's columns (``$COLUMNS`` first), at least 60; 100 when there is no terminal."""
    return max(60, shutil.get_terminal_size((100, 24)).columns)


def status_state(status: str) -> str:
    if status.startswith(("bit-exact", "pass")):
        return "ok"
    if status.startswith(("diverged", "failed", "fail")):
        return "bad"
    if status == NOT_MEASURED or status.startswith("skipped"):
        return "none"
    if status.startswith("warn"):
        return "warn"
    return ""


def _text(value: Any, style: str = "") -> Text:
    return Text(_clean(value), style=style)


def render_terminal(manifest: Mapping[str, Any], colour: bool | None = None, width: int | None = None,
                    signature: str | None = None, cost: Any = None) -> str:
    """The summary as text wrapped to ``width`` (default: the terminal's); colour only when asked
    or stdout is a TTY. ``signature``: the signature status line, for the verdict panel; ``cost``:
    the cost figures to show (default: the manifest's own price at the default target)."""
    from capture.termtable import Column, fit

    colour = _use_colour(sys.stdout) if colour is None else colour
    width = width or terminal_width()
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=colour, color_system="standard" if colour else None,
                  no_color=not colour, highlight=False, emoji=False, markup=False, soft_wrap=False)
    con.print(_text(title(manifest), "bold"))
    con.print("=" * min(width, 100))
    panel = Table.grid(padding=(0, 2))
    items = verdict_panel(manifest, signature, cost)
    panel.add_column(min_width=LABEL_WIDTH - 2, max_width=max(LABEL_WIDTH, min(24, width // 3)))
    panel.add_column()
    for v in items:
        panel.add_row(_text(v.label, "bold"), _text(v.value, _STYLES.get(v.state, "")))
    con.print(panel)
    con.print("-" * min(width, 100))
    for sec in sections(manifest, cost):
        head = Table.grid()
        head.add_column(no_wrap=True, width=LABEL_WIDTH)
        head.add_column()
        status = _clean(sec.status) if sec.status else ""
        head.add_row(_text(sec.title, "bold"), _text(status, _STYLES[status_state(status)]))
        con.print(head)
        if sec.rows:
            key_w = min(34, max(len(_clean(k)) for k, _ in sec.rows))
            rows = Table.grid(padding=(0, 2, 0, 0))
            rows.add_column(width=key_w)
            rows.add_column()
            for k, val in sec.rows:
                rows.add_row(_text(k), _text(val))
            con.print(Padding(rows, (0, 0, 0, LABEL_WIDTH)))
        for grid in sec.grids:
            cols = [Column(h) for h in grid.headers]
            cells = [[_clean(c) for c in row] for row in grid.rows]
            table = fit(cols, cells, width, indent=LABEL_WIDTH)
            narrow = fit(cols, cells, width, indent=2)  # a wide table takes the section's indent back
            use = table if len(table.lines) <= len(narrow.lines) * 1.5 else narrow
            for line in use.lines:
                con.print(_text(line), overflow="ignore", crop=False)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"

"""Plain-text tables and paragraphs that fit a terminal's width without breaking a word.

Every terminal reader (`capture decide`, `compare`, `show` and the trial report) lays its tables
out here. A column is never narrower than its longest word; when the columns cannot all have
that, headers are shortened first, then columns are left out in the caller's order (lowest
``drop`` first; ``drop=None`` is never left out), and the caller is told which. Cells wrap at
spaces, except in ``nowrap`` columns (figures with their unit, ids), which keep each cell on one
line. Where even the columns that must stay cannot stand side by side, each row becomes a block of
``header: value`` pairs (only a single word wider than the terminal is ever cut).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

RULE = "─"


@dataclass(frozen=True)
class Column:
    header: str
    short: str | None = None
    """A shorter header, used when the full ones do not fit."""
    drop: int | None = None
    """Left out when the table does not fit: lowest first; None: never."""
    right: bool = False
    """Right-aligned (figures)."""
    nowrap: bool = False
    """Cells stay on one line (a figure with its unit, an id, a path): the column is as wide as its widest cell."""
    min_width: int = 0
    """A wrapping column is at least this wide (else it could become a column of single words)."""


@dataclass
class Fitted:
    lines: list[str]
    dropped: list[str] = field(default_factory=list)
    """Headers of the columns left out to fit the width."""

    def text(self) -> str:
        return "\n".join(self.lines)


def _longest_word(text: str) -> int:
    return max((len(w) for w in text.split()), default=0)


def _natural(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


GLUE = "\xa0"
"""Joins words that must stay on one line (textwrap does not break at U+00A0); :func:`wrap` prints it as a space."""


def keep_together(text: str) -> str:
    """``text`` as one unbreakable unit for :func:`wrap` ("weights 1.70 GiB")."""
    return text.replace(" ", GLUE)


def keep_units(text: str) -> str:
    """``text`` with every number glued to the word after it ("8 MiB", "1980 MHz")."""
    return re.sub(r"(?<=\d) (?=\S)", GLUE, text)


def wrap(text: str, width: int, indent: str = "", subsequent: str | None = None, cut_long: bool = True) -> list[str]:
    """A paragraph wrapped at spaces to ``width``. A word wider than the line is cut, the last
    resort, or with ``cut_long=False`` left whole to overrun (a path, a hash). Words joined by
    :data:`GLUE` (:func:`keep_together`, :func:`keep_units`) stay on one line."""
    sub = indent if subsequent is None else subsequent
    lines = textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=sub, break_long_words=cut_long,
                          break_on_hyphens=False)
    return [line.replace(GLUE, " ") for line in lines] or [indent.rstrip()]


def cut(text: str, width: int, keep_end: bool = False) -> str:
    """``text`` on one line of at most ``width`` characters, ending in an ellipsis when cut;
    ``keep_end``: starting with one, the end kept (a dotted field path's last key names it)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    if keep_end:
        return "…" + text[len(text) - max(width - 1, 0):].lstrip() if width > 1 else "…"
    return text[: max(width - 1, 0)].rstrip() + "…"


def _widths(mins: list[int], naturals: list[int], room: int) -> list[int]:
    """Each column its minimum, then the room left shared out smallest need first, so that short
    cells stay whole and long text shares what remains evenly."""
    if sum(naturals) <= room:
        return naturals
    widths = list(mins)
    left = room - sum(mins)
    order = sorted(range(len(widths)), key=lambda i: naturals[i] - mins[i])
    for k, i in enumerate(order):
        share = left // (len(order) - k)
        give = min(naturals[i] - mins[i], share)
        widths[i] += give
        left -= give
    return widths


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, *, gap: int = 2, indent: int = 0,
        wide: bool = False) -> Fitted:
    """Lay ``rows`` out under ``columns`` in ``width`` characters (``indent`` included).
    ``wide``: every column, full headers, no wrapping (lines may be longer than ``width``)."""
    room = width - indent
    keep = list(range(len(columns)))

    def headers(short: bool) -> list[str]:
        return [(columns[i].short or columns[i].header) if short else columns[i].header for i in keep]

    def need(short: bool) -> list[int]:
        hs = headers(short)
        return [max([_longest_word(h)] + [min(columns[i].min_width, _natural(r[i])) for r in rows]
                    + [(_natural if columns[i].nowrap else _longest_word)(r[i]) for r in rows])
                for h, i in zip(hs, keep)]

    def fits(short: bool) -> bool:
        return sum(need(short)) + gap * (len(keep) - 1) <= room

    short = False
    dropped: list[str] = []
    if not wide and not fits(False):
        short = True
        order = sorted((c.drop, i) for i, c in enumerate(columns) if c.drop is not None)
        for _, i in order:
            if fits(True):
                break
            keep.remove(i)
            dropped.append(columns[i].header)
    hs = headers(short)
    mins = need(short)
    naturals = [max([_natural(h)] + [_natural(r[i]) for r in rows]) for h, i in zip(hs, keep)]
    naturals = [max(n, m) for n, m in zip(naturals, mins)]
    if wide:
        widths = naturals
    else:
        avail = room - gap * (len(keep) - 1)
        if sum(mins) > avail:  # even the columns that must stay do not fit side by side: one block per row
            return _records(columns, rows, width, indent)
        widths = _widths(mins, naturals, avail)
    pad = " " * indent
    sep = " " * gap

    def cells(values: list[str]) -> list[str]:
        wrapped = [textwrap.wrap(v, w, break_long_words=True, break_on_hyphens=False) or [""] if not wide else
                   (v.splitlines() or [""]) for v, w in zip(values, widths)]
        height = max(len(c) for c in wrapped)
        out = []
        for k in range(height):
            parts = []
            for j, (c, w) in enumerate(zip(wrapped, widths)):
                text = c[k] if k < len(c) else ""
                parts.append(text.rjust(w) if columns[keep[j]].right else text.ljust(w))
            out.append((pad + sep.join(parts)).rstrip())
        return out

    lines = cells(hs)
    lines.append(pad + RULE * (sum(widths) + gap * (len(widths) - 1)))
    for r in rows:
        lines += cells([r[i] for i in keep])
    return Fitted(lines, dropped)


def _records(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, indent: int) -> Fitted:
    """Each row as one paragraph of ``header: value`` pairs (every column: a block has room for
    them), wrapped at spaces: for a terminal too narrow for the columns that must stay side by side."""
    pad = " " * indent
    lines: list[str] = []
    for r in rows:
        text = " · ".join(f"{c.header}: {v}" for c, v in zip(columns, r) if v)
        lines += wrap(text, width, pad + "- ", pad + "  ")
    return Fitted(lines)


def say_wrapped(text: str, say: Callable[[str], None]) -> None:
    """``text`` as a command prints a long line on stderr (``say`` adds "capture: "): wrapped at 91
    columns, so 100 in all, the later lines indented, never between a number and its unit."""
    say("\n".join(wrap(keep_units(text), 91, "", "  ", cut_long=False)))

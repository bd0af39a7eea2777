"""The decision for the terminal and for programs (``--json``).

The terminal output opens with the answer, one line per group (:func:`headline`), then each
group's table, fitted to the terminal's width by :func:`capture.termtable.fit`: headers are
shortened first, then columns are left out in :data:`COLUMNS`' drop order (never the ranks, the
configuration, the run id, the three cost figures, the time or the signature), and the output says
which; ``--wide`` prints every column. Cells wrap at spaces, never inside a word.
"""

from __future__ import annotations

from typing import Any

from capture import costs
from capture.decide.rank import Config, Group
from capture.decide.runs import FileStatus
from capture.fmt import MISSING, bytes_str, number_str, percent_str, seconds_str
from capture.termtable import Column, fit, wrap

# (header, short header, drop order: lowest is left out first; None: never, wraps)
_COLUMNS: tuple[tuple[str, str | None, int | None, bool], ...] = (
    ("#cost", None, None, False),
    ("#time", None, None, False),
    ("configuration", "config", None, True),
    ("run", None, None, False),
    ("tokens/s", "tok/s", 6, False),
    ("efficiency", "eff.", 3, False),
    ("peak memory", "peak mem", 4, False),
    ("headroom", "free", 7, False),
    ("recovery", None, 2, True),
    ("preflight", None, 1, True),
    ("price/device-h", "price/h", 5, False),
    ("trial cost", None, None, False),
    ("steady cost / M tokens", "steady / M", None, False),
    ("cost to target", "to target", None, False),
    ("time to target", "time", None, False),
    ("signature", None, None, False),
)
COLUMNS = tuple(c[0] for c in _COLUMNS) + ("notes",)
"""The site's columns (the terminal lists notes under its table instead)."""
DROP_ORDER = tuple(c[0] for c in sorted((c for c in _COLUMNS if c[2] is not None), key=lambda c: c[2] or 0))
"""Columns the terminal leaves out first when they do not fit (docs/decide.md)."""


def _notes(c: Config) -> list[str]:
    notes = list(c.notes)
    if c.within_noise_of_best:
        notes.insert(0, "tokens/s within noise of #1")
    return notes


def row(c: Config) -> list[str]:
    """One configuration as the cells of :data:`COLUMNS` (the site uses the same cells)."""
    money = costs.money_str
    return [
        str(c.rank_cost) if c.rank_cost else "-",
        str(c.rank_time) if c.rank_time else "-",
        c.label,
        c.run_id,
        number_str(c.tokens_per_s) if c.tokens_per_s is not None else MISSING,
        number_str(c.efficiency) if c.efficiency is not None else MISSING,
        bytes_str(c.peak_memory_bytes),
        percent_str(c.headroom_fraction) if c.headroom_fraction is not None else MISSING,
        c.recovery or "not measured",
        c.preflight or "not run",
        f"{c.price.per_device_hour:g}" if c.price else MISSING,
        money(c.cost.trial_cost),
        money(c.cost.steady_cost_per_million_tokens),
        money(c.cost_to_target),
        seconds_str(c.time_to_target_s),
        c.run.file.state,
        "; ".join(_notes(c)),
    ]


def _config_text(c: Config) -> str:
    figs = [x for x in (c.cost.money(c.cost_to_target) if c.cost_to_target is not None else None,
                        seconds_str(c.time_to_target_s) if c.time_to_target_s is not None else None) if x]
    head = f", memory headroom {percent_str(c.headroom_fraction)}" if c.headroom_fraction is not None else ""
    return f"{c.label} (run {c.run_id}): {' and '.join(figs) or 'no figures'} to the target{head}"


def not_tested(g: Group) -> str:
    """What the group's runs did not test: catalog cards (memory estimate only) and more devices."""
    parts = []
    fit_yes = [u.name for u in g.untested if u.fits]
    fit_no = [u.name for u in g.untested if u.fits is False]
    fit_unknown = [u.name for u in g.untested if u.fits is None]
    if fit_yes:
        parts.append(", ".join(fit_yes) + " (would fit in memory, estimate)")
    if fit_no:
        parts.append(", ".join(fit_no) + " (would not fit in memory, estimate)")
    if fit_unknown:
        parts.append(", ".join(fit_unknown) + " (no memory measurement)")
    if not any(c.count > 1 for c in g.configs):
        parts.append("more than one device (no [scaling] run)")
    return "; ".join(parts) or "nothing in the catalog"


def headline(i: int, g: Group) -> str:
    """The answer for group ``i`` in one line: cheapest and fastest tested configuration with cost
    and time to the target and memory headroom, then what was not tested."""
    cheap, fast = g.cheapest, g.fastest
    if cheap is None and fast is None:
        answer = "nothing ranked (no trusted run with measured tokens/s)"
    elif cheap is None:
        answer = f"no price, so no cheapest; fastest {_config_text(fast)}"  # type: ignore[arg-type]
    elif fast is None or fast is cheap:
        answer = f"cheapest and fastest {_config_text(cheap)}"
    else:
        answer = f"cheapest {_config_text(cheap)}; fastest {_config_text(fast)}"
    return f"Group {i}: {answer}; not tested: {not_tested(g)}"


def nothing_ranked(files: list[FileStatus]) -> str:
    """The answer where no file holds a trial run (each file's reason is in the files table)."""
    return f"nothing ranked: none of the {len(files)} file(s) holds a trial run (Files says why)"


def target_lines(groups: list[Group], currency: str) -> list[str]:
    targets = {c.target.text() for g in groups for c in g.configs}
    where = targets.pop() if len(targets) == 1 else "each run's own training data, as each group says"
    if not groups or not any(g.configs for g in groups):
        where = costs.default_target().text()
    hint = "; --target-tokens N to change" if "the default target" in where else ""
    return [f"Target: {where}{hint}. Every cost in {currency}.",
            "Columns: trial cost = what the trial itself cost; steady / M = "
            f"{costs.STEADY_COST} (price x devices / measured tokens/s); to target, time = {costs.PROJECTED} "
            "(steady state plus validation, checkpoints and fixed costs at the run's schedule); docs/decide.md."]


def render(groups: list[Group], files: list[FileStatus], width: int | None = None, wide: bool = False,
           currency: str | None = None) -> str:
    from capture.trial.report.terminal import _clean, terminal_width

    width = width or terminal_width()
    currency = currency or next((c.cost.currency for g in groups for c in g.configs), costs.default_currency())
    out: list[str] = []

    def para(text: str, indent: str = "", sub: str | None = None) -> None:
        out.extend(wrap(_clean(text), width, indent, "  " if sub is None else sub) if not wide else [indent + _clean(text)])

    for line in target_lines(groups, currency):
        para(line)
    out.append("")
    out.append("The answer")
    for i, g in enumerate(groups, 1):
        para(headline(i, g), "  ", "    ")
    if not groups:
        para(nothing_ranked(files), "  ", "    ")
    columns = [Column(h, short, drop, nowrap=not wraps, min_width=12 if wraps else 0) for h, short, drop, wraps in _COLUMNS]
    for i, g in enumerate(groups, 1):
        out.append("")
        para(f"Group {i}: {g.definition.label()}")
        if g.left_out_reason:
            para(g.left_out_reason)
        if not g.configs:
            continue
        rows = [[_clean(x) for x in row(c)[:-1]] for c in g.configs]
        table = fit(columns, rows, width, wide=wide)
        out.extend(table.lines)
        prices = sorted({f"{c.card}: {c.price.per_device_hour:g} {c.price.currency} per device-hour, "
                         f"{c.price.source}" for c in g.configs if c.price})
        if prices:
            para("prices: " + "; ".join(prices))
        for c in g.configs:
            notes = _notes(c)
            if notes:
                para(f"{c.label} (run {c.run_id}): {'; '.join(notes)}", "", "  ")
        if table.dropped:
            para(f"left out at {width} columns: {', '.join(table.dropped)} (--wide shows every column)")
        fits = [f"{u.name} {'fits' if u.fits else 'does not fit' if u.fits is False else 'unknown'}" for u in g.untested]
        if fits:
            para(f"untested cards (memory only, estimate; no speed figures): {', '.join(fits)}")
    out.append("")
    out.append("Files")
    files_table = fit([Column("status"), Column("file", nowrap=True), Column("signer or reason"), Column("note")],
                      [[f.state.upper(), _clean(f.path), _clean(f.principal or f.reason or ""), _clean(f.note or "")]
                       for f in files], width, wide=wide)
    out.extend(files_table.lines)
    return "\n".join(line.rstrip() for line in out) + "\n"


def to_json(groups: list[Group], files: list[FileStatus], currency: str | None = None) -> dict[str, Any]:
    targets = sorted({(c.target.tokens, c.target.source) for g in groups for c in g.configs})
    return {
        "currency": currency or next((c.cost.currency for g in groups for c in g.configs), costs.default_currency()),
        "targets": [{"tokens": t, "source": s} for t, s in targets],
        "cost_figures": {"trial_cost": costs.TRIAL_COST, "steady_cost_per_million_tokens": costs.STEADY_COST,
                         "projected_cost, projected_time_s": costs.PROJECTED},
        "files": [f.to_json() for f in files],
        "groups": [{
            "definition": g.definition.to_json(),
            "headline": headline(i, g),
            "left_out_reason": g.left_out_reason,
            "runs": [r.path for r in g.runs],
            "configurations": [c.to_json() for c in g.configs],
            "untested_cards": [{"name": u.name, "memory_bytes": u.memory_bytes, "fits_estimate": u.fits,
                                "basis": u.basis} for u in g.untested],
        } for i, g in enumerate(groups, 1)],
    }

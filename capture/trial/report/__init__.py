"""Stage 9 of the trial: the report, as a terminal summary and a self-contained HTML file.

Both read only the manifest dict, so a report can be made for any manifest, including one
written by someone else on another machine: every string is escaped (``html.escape`` for HTML,
control characters for the terminal) and every section may be missing, in which case the report
says "not measured" instead of failing. Keys a section holds that the layout below does not know
are still shown, formatted by their unit suffix, so nothing recorded is hidden.

- ``values``: reading a manifest leniently, formatting a value by its key's unit (through capture.fmt)
- ``sections``: one :class:`Section` per stage; ``checks``: preflight, scaling, the verdict panel;
  ``layout``: the sections in run order
- ``terminal``: rich, wrapped to the terminal's width; ``html``: the page and its SVG plots
"""

from capture.fmt import bytes_str as fmt_bytes
from capture.fmt import seconds_str as fmt_seconds
from capture.trial.report.checks import HIGH_CV, Verdict, preflight_section, scaling_section, verdict_panel
from capture.trial.report.html import (CSS, grid_html, html_path_for, memory_svg, page, panel_html, render_html,
                                       report_body, step_time_svg, write_html)
from capture.trial.report.layout import sections
from capture.trial.report.sections import (Grid, Section, estimate_terms, fit_cards, measured_bars, stack_line,
                                           step_stats, step_times, title)
from capture.trial.report.terminal import render_terminal, terminal_width
from capture.trial.report.values import NOT_MEASURED, fmt_value, percentile

__all__ = [
    "CSS", "HIGH_CV", "NOT_MEASURED", "Grid", "Section", "Verdict", "estimate_terms", "fit_cards", "fmt_bytes",
    "fmt_seconds", "fmt_value", "grid_html", "html_path_for", "measured_bars", "memory_svg", "page", "panel_html",
    "percentile", "preflight_section", "render_html", "render_terminal", "report_body", "scaling_section", "sections",
    "stack_line", "step_stats", "step_time_svg", "step_times", "terminal_width", "title", "verdict_panel", "write_html",
]

"""The report's sections in the order the trial runs them (runner.py): preflight, the run
definition, memory, steps, validation, checkpoint, fit, recovery, scaling, then the cost of it all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.trial.report.checks import preflight_section, scaling_section
from capture.trial.report.sections import (Section, _cost_section, _fit_section, _memory_section, _recovery_section,
                                           _run_section, _simple_section, _steps_section, stack_line)
from capture.trial.report.values import _table


def sections(m: Mapping[str, Any], cost: Any = None) -> list[Section]:
    """The report's content, shared by the terminal and HTML renderers, in run order. ``cost``: the
    cost figures to show (:class:`capture.costs.CostFigures`; default: the manifest's own price at
    the default target)."""
    stack = Section("Stack", status=stack_line(m))
    host = _table(m, "host") or {}
    if host.get("hostname") or host.get("cpu_model"):
        stack.rows.append(("host", " · ".join(str(x) for x in (host.get("hostname"), host.get("cpu_model")) if x)))
    return [
        stack,
        preflight_section(m),
        _run_section(m),
        _memory_section(m),
        _steps_section(m),
        _simple_section(m, "Validation", "trial.validation"),
        _simple_section(m, "Checkpoint", "trial.checkpoint"),
        _fit_section(m),
        _recovery_section(m),
        scaling_section(m),
        _cost_section(m, cost),
    ]

"""Model FLOP utilisation both ways, as a person reads it: one row a figure, with its FLOPs per
token, its formula and the peak it is measured against.

``trial.stats`` records the 6N figure (``mfu``, ``mfu_6n``: the usual count, attention scores left
out) and the one with attention FLOPs (``mfu_with_attention``), each with its formula and inputs,
and the peak FLOP/s with its source. Listed key by key they were thirteen rows of raw numbers
(``9.89e+14``); here they are three.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.fmt import flops_str, number_str, percent_str
from capture.trial.report.values import _is_num, _label

KEYS = frozenset({"mfu", "mfu_6n", "mfu_with_attention", "flops_formula", "flops_formula_6n", "flops_per_token",
                  "flops_per_token_with_attention", "attention_flops_formula", "attention_flops_per_token",
                  "attention_flops_inputs", "peak_flops", "peak_flops_source"})
"""The keys of ``trial.stats`` the rows below show (the step-time keys are shown elsewhere)."""


def mfu_rows(stats: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows: the 6N MFU, the MFU with attention, the peak; nothing when neither was computed."""
    rows: list[tuple[str, str]] = []
    six = stats.get("mfu_6n", stats.get("mfu"))
    if _is_num(six):
        per = stats.get("flops_per_token")
        formula = stats.get("flops_formula_6n") or stats.get("flops_formula")
        rows.append(("MFU (6N)", percent_str(six, 2) + (f" · {flops_str(per)} a token" if _is_num(per) else "")
                     + (f" = {formula}" if formula else "")))
    att = stats.get("mfu_with_attention")
    if _is_num(att):
        per = stats.get("flops_per_token_with_attention")
        extra, formula = stats.get("attention_flops_per_token"), stats.get("attention_flops_formula")
        inputs = stats.get("attention_flops_inputs")
        given = ", ".join(f"{_label(str(k))} {number_str(v) if _is_num(v) else v}" for k, v in inputs.items()) \
            if isinstance(inputs, Mapping) else ""
        rows.append(("MFU with attention", percent_str(att, 2) + (f" · {flops_str(per)} a token" if _is_num(per) else "")
                     + (f", of which attention {flops_str(extra)}" if _is_num(extra) else "")
                     + (f" = {formula}" if formula else "") + (f" ({given})" if given else "")))
    peak = stats.get("peak_flops")
    if rows and _is_num(peak):
        source = stats.get("peak_flops_source")
        rows.append(("peak", flops_str(peak, per_s=True) + (f" ({source})" if source else "")))
    return rows

"""Sections for the checks around the single-device run: preflight, scaling, and the verdict panel.

Preflight follows the shared ``[preflight]`` table (mode, verdict, duration_s, device_kind,
``[[preflight.checks]]``); scaling follows ``[scaling]`` (docs/scaling.md). Both are read
leniently: a foreign or older manifest shows what it has and "not measured" for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capture.fmt import bytes_str, number_str, percent_str, seconds_str
from capture.manifest import table_at
from capture.trial.report.sections import Grid, Section, _generic_rows, _skipped, opened, stack_line
from capture.trial.report.values import NOT_MEASURED, _is_num, _table

STRATEGIES = ("ddp", "fsdp")


def preflight_section(m: Mapping[str, Any]) -> Section:
    sec, pre = opened(m, "Preflight", "preflight")
    if pre is None or sec.status:
        return sec
    parts = [str(pre.get("verdict", "?"))]
    extra = [str(x) for x in (pre.get("mode") and f"{pre['mode']} mode", pre.get("device_kind"),
                              _is_num(pre.get("duration_s")) and seconds_str(pre["duration_s"])) if x]
    sec.status = parts[0] + (f" ({', '.join(extra)})" if extra else "")
    sec.rows = _generic_rows(pre, {"verdict", "mode", "device_kind", "duration_s", "checks"})
    checks = [c for c in pre.get("checks") or [] if isinstance(c, Mapping)]
    if checks:
        rows = []
        for c in checks:
            value = c.get("value")
            shown = (number_str(value) if _is_num(value) else str(value)) if value is not None else ""
            if shown and c.get("unit"):
                shown += f" {c['unit']}"
            rows.append([str(c.get("name", "?")), "" if c.get("device") is None else str(c.get("device")),
                         str(c.get("verdict", "?")), shown, str(c.get("expected", "")), str(c.get("reason", ""))])
        sec.grids.append(Grid(["check", "device", "verdict", "value", "expected", "reason"], rows))
    return sec


def _strategy_cell(t: Mapping[str, Any], col: str, key: str) -> str:
    s = table_at(t, col)
    if key == "fits":
        return "-" if not s else ("no (out of memory)" if s.get("fits") is False else "yes")
    if s.get("fits") is False:  # out of memory: a verdict, no figures
        return "-"
    if key == "throughput":
        v = s.get("throughput_tokens_per_s")
        return f"{number_str(v)} tok/s" if _is_num(v) else "-"
    if key == "efficiency":
        ref = table_at(t, "efficiency_reference")
        if col == "baseline" and ref.get("world_size", 1) == 1:
            return "1 (by definition)"
        return number_str(s.get("efficiency")) if _is_num(s.get("efficiency")) else "-"
    if key == "step":
        med, p90 = s.get("step_time_median_s"), s.get("step_time_p90_s")
        return f"{seconds_str(med) if _is_num(med) else '-'} / {seconds_str(p90) if _is_num(p90) else '-'}"
    if key == "cv":
        return percent_str(s["step_time_cv"], 2) if _is_num(s.get("step_time_cv")) else "-"
    if key == "memory":
        v = s.get("peak_memory_per_rank_bytes")
        return bytes_str(v) if _is_num(v) else "-"
    if key == "comm":
        share = s.get("comm_share")
        return percent_str(share) if _is_num(share) else ("-" if col == "baseline" else "not attributable")
    if key == "restore":
        rec = table_at(s, "recovery")
        return str(rec.get("verdict", "-"))
    return "-"


def scaling_section(m: Mapping[str, Any]) -> Section:
    """DDP and FSDP side by side with the single-device baseline of the same launch."""
    sec, t = opened(m, "Scaling", "scaling")
    if t is None or sec.status:
        return sec
    n = t.get("world_size", "?")
    coll = table_at(t, "collective")
    sec.status = str(t.get("reading") or f"{n} ranks")
    sec.rows.append(("ranks", f"{n} on {t.get('device_type', '?')}"
                     + (f", {coll.get('library')} {coll.get('version', '')}".rstrip() if coll.get("library") else "")))
    batch = table_at(t, "batch")
    if _is_num(batch.get("tokens_per_optimizer_step")):
        sec.rows.append(("global batch", f"{number_str(batch['tokens_per_optimizer_step'])} tokens per optimizer step "
                         f"for every column (per rank {batch.get('per_rank_micro_batch', '?')} x "
                         f"{batch.get('per_rank_grad_accum', '?')}; {batch.get('method', '?')})"))
    cols = ["baseline"] + [s for s in STRATEGIES if isinstance(t.get(s), Mapping)]
    heads = {"baseline": "1 device", "ddp": f"DDP x{n}", "fsdp": f"FSDP x{n}"}
    rows = [[label] + [_strategy_cell(t, c, key) for c in cols]
            for label, key in (("fits", "fits"), ("useful throughput", "throughput"), ("scaling efficiency", "efficiency"),
                               ("step time median / p90", "step"), ("step time CV", "cv"),
                               ("peak memory per rank", "memory"), ("communication share", "comm"),
                               ("restore in fresh processes", "restore"))]
    sec.grids.append(Grid([""] + [heads[c] for c in cols], rows))
    basis = next((t[c].get("memory_basis") for c in cols if isinstance(t.get(c), Mapping) and t[c].get("memory_basis")), None)
    if basis:
        sec.rows.append(("memory basis", str(basis)))
    if t.get("efficiency_definition"):
        sec.rows.append(("efficiency", str(t["efficiency_definition"])))
    ref = table_at(t, "efficiency_reference")
    if ref.get("basis"):
        sec.rows.append(("efficiency against", f"{ref.get('shape', '?')}: {ref['basis']}"))
    for c in cols:
        s = table_at(t, c)
        if s.get("fits") is False:
            sec.rows.append((heads[c], str(s.get("verdict", "does not fit")) + (f" ({s['oom']})" if s.get("oom") else "")))
    for note in t.get("notes") or []:
        sec.rows.append(("note", str(note)))
    return sec


@dataclass(frozen=True)
class Verdict:
    """One item of the panel at the top of the report."""

    label: str
    value: str
    state: str
    """``ok``, ``bad``, ``warn`` or ``none`` (not measured): the colour it is shown in."""


def _state_of(text: str) -> str:
    low = text.lower()
    if low.startswith(("bit-exact", "pass", "fits", "signature valid, signer trusted", "ok")):
        return "ok"
    if low.startswith(("diverged", "failed", "fail", "does not fit", "not signed", "signature invalid", "invalid",
                       "unsigned", "tampered")) or "not trusted" in low:
        return "bad"
    if low.startswith(("warn", "skipped")):
        return "warn"
    if low in (NOT_MEASURED, "-"):
        return "none"
    return ""


def verdict_panel(m: Mapping[str, Any], signature: str | None = None, cost: Any = None) -> list[Verdict]:
    """Signature, stack, fit with headroom, recovery, tokens/s, MFU, the three cost figures
    (:mod:`capture.costs`; ``cost``: figures a caller computed), preflight and scaling."""
    out: list[Verdict] = []

    def add(label: str, value: str, state: str | None = None) -> None:
        out.append(Verdict(label, value, _state_of(value) if state is None else state))

    if signature:
        add("signature", signature)
    add("stack", stack_line(m), "")
    pre = _table(m, "preflight")
    if pre and pre.get("verdict"):
        add("preflight", str(pre["verdict"]))
    fit = _table(m, "trial.fit") or {}
    got = fit.get("cards")  # a signed file may hold any type here
    cards = got if isinstance(got, list) else []
    tested = next((c for c in cards if isinstance(c, Mapping) and c.get("tested") is True), None)
    if isinstance(fit.get("fits"), bool):
        head = tested.get("headroom_fraction") if tested else None
        where = f" on {tested.get('name')}" if tested and tested.get("name") else ""
        add("fits", ("fits" if fit["fits"] else "does not fit") + where
            + (f", {percent_str(head)} headroom" if _is_num(head) and fit["fits"] else ""))
    else:
        add("fits", NOT_MEASURED)
    rec = _table(m, "trial.recovery") or {}
    add("recovery", str(rec.get("verdict") or _skipped(rec) or NOT_MEASURED))
    stats = _table(m, "trial.stats") or {}
    tps = stats.get("tokens_per_s")
    cv = stats.get("step_time_cv")
    add("tokens/s", (f"{number_str(tps)} tok/s" if _is_num(tps) else NOT_MEASURED)
        + (f" (step CV {percent_str(cv, 2)}{', HIGH' if cv > HIGH_CV else ''})" if _is_num(cv) else ""),
        "warn" if _is_num(cv) and cv > HIGH_CV else "" if _is_num(tps) else "none")
    if stats.get("loss_finite") is False:
        add("loss", f"NOT FINITE from measured step {stats.get('loss_first_nonfinite_step', '?')}", "warn")
    mfu = stats.get("mfu")
    add("MFU", percent_str(mfu) if _is_num(mfu) else str(stats.get("mfu_note") or NOT_MEASURED), "" if _is_num(mfu) else "none")
    if _table(m, "trial.cost"):
        from capture import costs

        fig = cost if cost is not None else costs.figures(m)
        priced = fig.trial_cost is not None or fig.steady_cost_per_million_tokens is not None
        for name, text in fig.texts():
            add(name, text, "" if priced or name == costs.PROJECTED and fig.projection else "none")
    else:
        add("cost", NOT_MEASURED, "none")
    scaling = _table(m, "scaling")
    if scaling and not _skipped(scaling):
        effs = [(s, scaling[s]["efficiency"]) for s in STRATEGIES
                if isinstance(scaling.get(s), Mapping) and _is_num(scaling[s].get("efficiency"))]
        if effs:
            add("scaling", ", ".join(f"{s.upper()} x{scaling.get('world_size', '?')} efficiency {number_str(e)}"
                                     for s, e in effs), "")
    return out


HIGH_CV = 0.05
"""A step-time coefficient of variation above this is called out as noisy (docs/decide.md)."""

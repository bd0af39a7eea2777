"""Stage 9 of the trial: the report, as a terminal summary and a self-contained HTML file.

Both read only the manifest dict, so a report can be made for any manifest, including one
written by someone else on another machine: every string is escaped (``html.escape`` for HTML,
control characters for the terminal) and every section may be missing, in which case the report
says "not measured" instead of failing. Keys a section holds that the layout below does not know
are still shown, formatted by their unit suffix, so nothing recorded is hidden.
"""

from __future__ import annotations

import html
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture._atomic import atomic_write

NOT_MEASURED = "not measured"


# --------------------------------------------------------------------------- values


def _get(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _table(data: Any, dotted: str) -> dict[str, Any] | None:
    value = _get(data, dotted)
    return dict(value) if isinstance(value, Mapping) else None


def _first(table: Mapping[str, Any] | None, *keys: str) -> Any:
    if not table:
        return None
    for k in keys:
        if table.get(k) is not None:
            return table[k]
    return None


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(v: Any) -> list[float]:
    if not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        return []
    return [float(x) for x in v if _is_num(x)]


def fmt_bytes(n: float) -> str:
    """Binary units, as the cards' capacities are quoted by the tools (GiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if abs(s) < 1:
        return f"{s * 1e3:.1f} ms"
    if abs(s) < 120:
        return f"{s:.2f} s"
    if abs(s) < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


_PERCENT_SUFFIXES = ("_fraction", "_ratio", "_cv", "_share", "_error", "mfu", "headroom")


def fmt_value(key: str, v: Any) -> str:
    """Format by the unit in the key's name (``_bytes``, ``_s``, ``_per_s``, ``_share`` ...)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={fmt_value(str(k), x)}" for k, x in v.items())
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        nums = _numbers(v)
        if len(v) > 6:
            return f"{len(v)} values" + (f" ({fmt_value(key, min(nums))} .. {fmt_value(key, max(nums))})" if nums else "")
        return ", ".join(fmt_value(key, x) for x in v) if v else "none"
    if not _is_num(v):
        return str(v)
    if key.endswith("_per_s"):
        if key.startswith("bytes") or key.endswith("bytes_per_s"):
            return f"{fmt_bytes(v)}/s"
        if "token" in key:
            return f"{v:,.0f} tok/s"
        return f"{v:,.4g}/s"
    if key.endswith("_bytes"):
        return fmt_bytes(v)
    if key.endswith("_s"):
        return fmt_seconds(v)
    if key.endswith(_PERCENT_SUFFIXES) or key == "cv":
        return f"{v * 100:+.1f} %" if key.endswith("_error") else f"{v * 100:.2f} %"
    if key.endswith("_w"):
        return f"{v:.0f} W"
    if key.endswith("_h"):
        return f"{v:.2f} h"
    if isinstance(v, int):
        return f"{v:,}"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        return f"{v:.4g}"
    return f"{v:.6g}"


def _label(key: str) -> str:
    if key.endswith("_per_s"):
        return key[: -len("_per_s")].replace("_", " ") + "/s"
    for suffix in ("_bytes", "_s"):
        if key.endswith(suffix) and key != suffix:
            key = key[: -len(suffix)]
            break
    return key.replace("_", " ")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --------------------------------------------------------------------------- the model both renderers share


@dataclass
class Grid:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    grids: list[Grid] = field(default_factory=list)
    status: str | None = None
    """A one-line verdict for the section; ``not measured`` when it is absent."""


def _generic_rows(table: Mapping[str, Any] | None, known: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Every key not shown otherwise, formatted by its unit (arrays of tables are left to grids)."""
    if not table:
        return []
    return [(_label(k), fmt_value(k, v)) for k, v in table.items()
            if k not in known and not (isinstance(v, list) and v and isinstance(v[0], Mapping))]


def _skipped(table: Mapping[str, Any] | None) -> str | None:
    if table and isinstance(table.get("skipped"), str):
        return f"skipped: {table['skipped']}"
    return None


def stack_line(m: Mapping[str, Any]) -> str:
    acc = _table(m, "accelerator") or {}
    fw = _table(m, "framework") or {}
    nv = _table(m, "nvidia") or {}
    parts = []
    if acc.get("count") == 0:
        parts.append(f"no accelerator ({acc.get('model') or 'cpu'})")
    elif acc.get("model"):
        count = acc.get("count")
        parts.append(f"{acc['model']}" + (f" ×{count}" if _is_num(count) and count != 1 else ""))
    elif acc.get("vendor"):
        parts.append(str(acc["vendor"]))
    else:
        parts.append("no accelerator recorded")
    driver = acc.get("driver_version") or nv.get("driver_version")
    if driver:
        parts.append(f"driver {driver}")
    if acc.get("runtime") and acc.get("runtime_version"):
        parts.append(f"{acc['runtime']} {acc['runtime_version']}")
    elif nv.get("cuda_driver_version"):
        parts.append(f"CUDA driver {nv['cuda_driver_version']}")
    if fw.get("version"):
        built = fw.get("cuda_version") and f"CUDA {fw['cuda_version']}" or fw.get("hip_version") and f"HIP {fw['hip_version']}"
        parts.append(f"{fw.get('name', 'torch')} {fw['version']}" + (f" ({built})" if built else ""))
    return " · ".join(str(p) for p in parts)


def _summary(table: Any, *keys: str) -> str | None:
    """``a · label b · label c`` from the keys of a sub-table that are present (names unlabelled)."""
    if not isinstance(table, Mapping):
        return None
    names = {"name", "repo_id", "path", "architecture", "class", "weights", "source", "tokenizer", "device", "device_name"}
    parts = []
    for k in keys:
        v = table.get(k)
        if v is None:
            continue
        text = f"{v:g}" if k == "lr" and _is_num(v) else fmt_value(k, v)
        parts.append(text if k in names else f"{_label(k)} {text}")
    return " · ".join(parts) or None


def _run_section(m: Mapping[str, Any]) -> Section:
    run = _table(m, "trial.run")
    sec = Section("Run")
    if not run:
        sec.status = NOT_MEASURED
        return sec
    sec.status = _skipped(run)
    trial = _table(m, "trial") or {}
    shown: set[str] = {"skipped"}

    def row(label: str, value: str | None, *keys: str) -> None:
        shown.update(keys)
        if value:
            sec.rows.append((label, value))

    row("name", run.get("name") and str(run["name"]), "name")
    if trial.get("config_source"):
        over = trial.get("overrides")
        row("config", str(trial["config_source"]) + (f" (overrides: {fmt_value('', over)})" if isinstance(over, Mapping) and over else ""))
    row("device", _summary(run, "device", "device_name"), "device", "device_name")
    row("method", run.get("method") and str(run["method"]), "method")
    model = run.get("model")
    row("model", _summary(model, "repo_id", "path", "architecture", "class", "commit", "weights"), "model")
    if _is_num(run.get("params_trainable")):
        total = run.get("params_total")
        share = run.get("trainable_share")
        row("parameters", f"{run['params_trainable']:,} trainable" + (f" of {total:,}" if _is_num(total) else "")
            + (f" ({share * 100:.2f} %)" if _is_num(share) else ""), "params_trainable", "params_total", "trainable_share")
    if isinstance(run.get("lora"), Mapping):
        row("lora", _summary(run["lora"], "rank", "alpha", "dropout", "target_modules"), "lora")
    row("optimizer", _summary(run.get("optimizer"), "name", "lr", "weight_decay", "betas", "fused"), "optimizer")
    row("scheduler", _summary(run.get("scheduler"), "name", "warmup_steps", "horizon_steps"), "scheduler")
    prec = run.get("precision")
    if isinstance(prec, Mapping):
        row("precision", " · ".join(filter(None, [str(prec.get("dtype", "")), "autocast" if prec.get("autocast") else "",
                                                  f"weights {prec['weights_dtype']}" if prec.get("weights_dtype") else "",
                                                  "grad scaler" if prec.get("grad_scaler") else ""])), "precision")
    batch = [f"{label} {run[k]:,}" for k, label in (("max_seq_len", "seq"), ("micro_batch_size", "micro-batch"),
                                                   ("grad_accum", "grad-accum"), ("tokens_per_step", "tokens/step"))
             if _is_num(run.get(k))]
    row("batch", " · ".join(batch), "max_seq_len", "micro_batch_size", "grad_accum", "tokens_per_step")
    data = run.get("data")
    row("data", _summary(data, "name", "repo_id", "path", "source", "tokenizer", "train_tokens"), "data")
    if _is_num(run.get("measured_steps")):
        row("steps", f"{run.get('warmup_steps', 0)} warm-up + {run['measured_steps']} measured", "warmup_steps", "measured_steps")
    sec.rows += _generic_rows(run, shown)
    return sec


def _measured_reference(measured: Mapping[str, Any]) -> tuple[str, float] | None:
    for keys, label in ((("device_used_bytes",), "device used"), (("peak_reserved_bytes", "max_reserved_bytes"), "peak reserved"),
                        (("peak_allocated_bytes", "max_allocated_bytes"), "peak allocated")):
        v = _first(measured, *keys)
        if _is_num(v):
            return label, float(v)
    return None


_ESTIMATE_NOT_TERMS = frozenset({"total_bytes", "allocator_bytes"})


def estimate_terms(estimate: Mapping[str, Any] | None) -> list[tuple[str, float]]:
    """The estimate's terms: sub-tables with ``bytes`` (runner layout) or ``<term>_bytes`` keys."""
    if not estimate:
        return []
    out = []
    for k, v in estimate.items():
        if isinstance(v, Mapping) and _is_num(v.get("bytes")):
            out.append((k.replace("_", " "), float(v["bytes"])))
        elif k.endswith("_bytes") and k not in _ESTIMATE_NOT_TERMS and _is_num(v):
            out.append((_label(k), float(v)))
    return out


def _estimate_total(estimate: Mapping[str, Any] | None) -> float | None:
    if not estimate:
        return None
    if _is_num(estimate.get("total_bytes")):
        return float(estimate["total_bytes"])
    terms = estimate_terms(estimate)
    return sum(v for _, v in terms) if terms else None


_MEASURED_KEYS = (("peak_allocated_bytes", "max_allocated_bytes"), ("peak_reserved_bytes", "max_reserved_bytes"),
                  ("device_used_bytes",))


def measured_bars(meas: Mapping[str, Any] | None) -> list[tuple[str, float]]:
    out = []
    for keys in _MEASURED_KEYS:
        v = _first(meas, *keys)
        if _is_num(v):
            out.append((_label(keys[0]), float(v)))
    return out


def _memory_section(m: Mapping[str, Any]) -> Section:
    sec = Section("Memory")
    mem = _table(m, "trial.memory") or {}
    est = _table(m, "trial.memory.estimate")
    meas = _table(m, "trial.memory.measured")
    total = _estimate_total(est)
    ref = _measured_reference(meas) if meas else None
    if total is None and not meas:
        sec.status = _skipped(mem) or (f"skipped: {mem['estimate_skipped']}" if mem.get("estimate_skipped") else NOT_MEASURED)
        return sec
    sec.rows.append(("estimate", fmt_bytes(total) if total is not None else NOT_MEASURED))
    if est:
        for k, v in est.items():
            if isinstance(v, Mapping) and _is_num(v.get("bytes")):
                formula = f"  ({v['formula']})" if v.get("formula") else ""
                sec.rows.append((f"  {k.replace('_', ' ')}", fmt_bytes(v["bytes"]) + formula))
            elif k == "total_bytes":
                continue
            elif k == "allocator_bytes":
                sec.rows.append(("  (seen by the allocator)", fmt_value(k, v)))
            elif k.endswith("_bytes"):
                sec.rows.append((f"  {_label(k)}", fmt_value(k, v)))
            elif k != "note":
                sec.rows.append((f"  {_label(k)}", fmt_value(k, v)))
    if meas:
        for label, v in measured_bars(meas):
            sec.rows.append((f"measured {label}", fmt_bytes(v)))
        sec.rows += [(f"  {a}", b) for a, b in _generic_rows(meas, {k for keys in _MEASURED_KEYS for k in keys})]
    else:
        sec.rows.append(("measured", NOT_MEASURED))
    sec.rows += _generic_rows(mem, {"estimate", "measured", "skipped"})
    err = mem.get("estimate_error")
    if total is not None and ref is not None and ref[1] > 0:
        if not _is_num(err):
            err = (total - ref[1]) / ref[1]
        sec.status = f"estimate {fmt_bytes(total)} vs measured {fmt_bytes(ref[1])} {ref[0]} (error {err * 100:+.1f} %)"
    return sec


def step_times(m: Mapping[str, Any]) -> tuple[list[float], int]:
    """(warm-up step times then measured ones, how many leading ones are warm-up)."""
    steps = _table(m, "trial.steps") or {}
    times = _numbers(steps.get("step_time_s"))
    warmup = _numbers(steps.get("warmup_step_time_s"))
    if warmup:
        return warmup + times, len(warmup)
    warm = steps.get("warmup_steps")  # alternative layout: warm-up steps inside step_time_s
    warm = int(warm) if _is_num(warm) else 0
    return times, max(0, min(warm, len(times)))


def step_stats(m: Mapping[str, Any]) -> dict[str, float]:
    """Median/p90/CV over the measured (post-warm-up) steps: the manifest's, else computed."""
    stats = _table(m, "trial.stats") or {}
    times, warm = step_times(m)
    measured = times[warm:]
    out: dict[str, float] = {}
    if measured:
        out["median"] = statistics.median(measured)
        out["p90"] = percentile(measured, 90)
        mean = statistics.fmean(measured)
        out["cv"] = statistics.pstdev(measured) / mean if mean > 0 else 0.0
    for name, keys in (("median", ("step_time_median_s",)), ("p90", ("step_time_p90_s",)), ("cv", ("step_time_cv",))):
        v = _first(stats, *keys)
        if _is_num(v):
            out[name] = float(v)
    return out


def _steps_section(m: Mapping[str, Any]) -> Section:
    sec = Section("Steps")
    stats = _table(m, "trial.stats")
    steps = _table(m, "trial.steps")
    times, warm = step_times(m)
    s = step_stats(m)
    if not s:
        sec.status = _skipped(stats) or _skipped(steps) or NOT_MEASURED
        sec.rows = _generic_rows(stats, {"skipped"})
        return sec
    sec.status = f"median {fmt_seconds(s['median'])}, p90 {fmt_seconds(s['p90'])}" + (
        f", CV {s['cv'] * 100:.2f} %" if "cv" in s else "")
    if times:
        sec.rows.append(("steps", f"{len(times) - warm} measured after {warm} warm-up"))
    waits = _numbers((steps or {}).get("data_wait_s"))
    if waits and times:
        total = sum(times[warm:])
        sec.rows.append(("data wait", f"{fmt_seconds(sum(waits))} in total, max {fmt_seconds(max(waits))}"
                         + (f" ({sum(waits) / total * 100:.2f} % of step time)" if total > 0 else "")))
    losses = _numbers((steps or {}).get("loss"))
    if losses:
        sec.rows.append(("loss", f"{losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps"))
    sec.rows += _generic_rows(stats, {"step_time_median_s", "step_time_p90_s", "step_time_cv", "skipped"})
    return sec


def _simple_section(m: Mapping[str, Any], title: str, dotted: str) -> Section:
    table = _table(m, dotted)
    sec = Section(title)
    if not table:
        sec.status = NOT_MEASURED
        return sec
    sec.status = _skipped(table)
    sec.rows = _generic_rows(table, {"skipped", "phases"})
    return sec


def _cost_section(m: Mapping[str, Any]) -> Section:
    sec = _simple_section(m, "Cost", "trial.cost")
    cost = _table(m, "trial.cost") or {}
    if _is_num(cost.get("trial_cost")):
        sec.status = f"{cost['trial_cost']:.4g} for the whole trial" + (
            f" ({cost['cost_per_million_trained_tokens']:.4g} per million trained tokens)"
            if _is_num(cost.get("cost_per_million_trained_tokens")) else "")
    phases = cost.get("phases")
    if isinstance(phases, Mapping) and phases:
        wall = cost.get("wall_total_s")
        rows = [[_label(k), fmt_value(k, v), f"{v / wall * 100:.1f} %" if _is_num(v) and _is_num(wall) and wall else ""]
                for k, v in phases.items()]
        sec.grids.append(Grid(["phase", "wall time", "share"], rows))
    return sec


def fit_cards(m: Mapping[str, Any]) -> list[dict[str, Any]]:
    fit = _get(m, "trial.fit")
    cards = fit.get("cards") if isinstance(fit, Mapping) else fit
    if not isinstance(cards, list):
        return []
    return [dict(c) for c in cards if isinstance(c, Mapping)]


def _card_capacity(card: Mapping[str, Any]) -> float | None:
    v = _first(card, "memory_bytes", "memory_per_device_bytes", "memory_total_bytes")
    return float(v) if _is_num(v) else None


def _fit_section(m: Mapping[str, Any]) -> Section:
    sec = Section("Fit")
    fit = _table(m, "trial.fit")
    cards = fit_cards(m)
    if not fit and not cards:
        sec.status = NOT_MEASURED
        return sec
    fit = fit or {}
    sec.status = _skipped(fit) or (str(fit["verdict"]) if fit.get("verdict") else None)
    sec.rows = _generic_rows(fit, {"verdict", "skipped", "cards", "search"})
    search = fit.get("search")
    if isinstance(search, Mapping):
        sec.rows.append(("largest micro-batch", fmt_value("", search.get("max_micro_batch", "?"))))
        sec.rows += [(f"  {a}", b) for a, b in _generic_rows(search, {"max_micro_batch"})]
    if not cards:
        return sec
    bases = {str(c.get("basis", "")) for c in cards}
    shared_basis = len(bases) == 1
    if shared_basis and bases != {""}:
        sec.rows.append(("card basis", bases.pop()))
    rows = []
    for c in cards:
        cap = _card_capacity(c)
        head, frac, margin = c.get("headroom_bytes"), c.get("headroom_fraction"), c.get("margin_bytes")
        fits = c.get("fits")
        row = [str(_first(c, "name", "card", "model") or "?"),
               fmt_bytes(cap) if cap is not None else "?",
               (fmt_bytes(head) if _is_num(head) else "?") + (f" ({frac * 100:.1f} %)" if _is_num(frac) else ""),
               fmt_bytes(margin) if _is_num(margin) else "",
               ("yes" if fits else "no") if isinstance(fits, bool) else "?",
               "yes" if c.get("tested") is True else "no" if c.get("tested") is False else "?"]
        if not shared_basis:
            row.append(str(c.get("basis", "")))
        rows.append(row)
    headers = ["card", "memory", "free after run", "margin to headroom", "fits", "tested"]
    sec.grids.append(Grid(headers + ([] if shared_basis else ["basis"]), rows))
    return sec


def _recovery_section(m: Mapping[str, Any]) -> Section:
    rec = _table(m, "trial.recovery")
    sec = Section("Recovery")
    if not rec:
        sec.status = NOT_MEASURED
        return sec
    if _skipped(rec):
        sec.status = _skipped(rec)
        return sec
    verdict = str(rec.get("verdict", NOT_MEASURED))
    k, n = rec.get("save_at_step"), rec.get("total_steps")
    where = f" (checkpoint after step {k} of {n}" + (", restored in a fresh process)" if rec.get("fresh_process") else ")")
    sec.status = verdict + (where if _is_num(k) and _is_num(n) else "")
    withheld = rec.get("withheld") or []
    if withheld:
        outcome = verdict if verdict != "bit-exact" else "bit-exact: the continuation does not depend on it"
        sec.rows.append(("WITHHELD on purpose", f"{', '.join(map(str, withheld))} → {outcome}"))
    if _is_num(rec.get("loss_diff")) and rec["loss_diff"] != 0 and rec.get("diverged_at_step") is not None:
        sec.rows.append(("loss diff at divergence", f"{rec['loss_diff']:+.6g} (resumed − uninterrupted)"))
    repeat = rec.get("restore_repeat")
    if isinstance(repeat, str):
        if repeat == "identical":
            why = "" if withheld else ": the checkpoint lacks state, or the fresh process computes differently"
            sec.rows.append(("second restore", f"identical to the first{why}"))
        else:
            off = " (torch deterministic algorithms were off)" if rec.get("deterministic_algorithms") is False else ""
            sec.rows.append(("second restore", f"{repeat}: the training step is not deterministic on this stack{off}"))
    if _is_num(rec.get("max_abs_param_diff")):
        sec.rows.append(("max |param diff| at end", f"{rec['max_abs_param_diff']:.3g}"))
    same = rec.get("param_hash_resumed") is not None and rec.get("param_hash_resumed") == rec.get("param_hash_uninterrupted")
    if rec.get("param_hash_uninterrupted"):
        sec.rows.append(("parameter hash", ("equal " if same else "differs ") + str(rec["param_hash_uninterrupted"])[:23] + "…"))
    for key in ("checkpoint_size_bytes", "checkpoint_write_s", "restore_load_s", "sensitivity_control", "elapsed_s"):
        if rec.get(key) is not None:
            sec.rows.append((_label(key), fmt_value(key, rec[key])))
    sens = [s for s in rec.get("sensitivity") or [] if isinstance(s, Mapping)]
    if sens:
        rows = []
        for s in sens:
            applicable = s.get("applicable", True)
            if not applicable:
                rows.append([str(s.get("component", "?")), "not applicable", "", "", str(s.get("note", ""))])
                continue
            dep = s.get("depends")
            at = s.get("diverged_at_step")
            diff = s.get("loss_diff")
            rows.append([str(s.get("component", "?")),
                         "yes" if dep is True else "no" if dep is False else "?",
                         str(at) if at is not None else "",
                         f"{diff:+.3g}" if _is_num(diff) and diff else "",
                         str(s.get("note", ""))])
        sec.grids.append(Grid(["withheld component", "depends", "diverged at step", "loss diff", "note"], rows))
    return sec


def sections(m: Mapping[str, Any]) -> list[Section]:
    """The report's content, shared by the terminal and HTML renderers."""
    stack = Section("Stack", status=stack_line(m))
    host = _table(m, "host") or {}
    if host.get("hostname") or host.get("cpu_model"):
        stack.rows.append(("host", " · ".join(str(x) for x in (host.get("hostname"), host.get("cpu_model")) if x)))
    return [
        stack,
        _run_section(m),
        _memory_section(m),
        _steps_section(m),
        _simple_section(m, "Validation", "trial.validation"),
        _simple_section(m, "Checkpoint", "trial.checkpoint"),
        _fit_section(m),
        _recovery_section(m),
        _cost_section(m),
    ]


def title(m: Mapping[str, Any]) -> str:
    name = _get(m, "trial.run.name") or _get(m, "trial.name")
    when = m.get("created_utc") if isinstance(m, Mapping) else None
    return "capture trial report" + (f": {name}" if name else "") + (f" ({when})" if when else "")


# --------------------------------------------------------------------------- terminal


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09,)}


def _clean(text: Any) -> str:
    """Neutralise control characters (escape sequences in a foreign manifest must not reach the TTY)."""
    return str(text).translate(_CONTROL)


def _fit_width(line: str, width: int) -> str:
    """The terminal is a summary: a long value is cut (the HTML report and the manifest keep it whole)."""
    return line if len(line) <= width else line[: width - 1] + "…"


def _use_colour(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def render_terminal(manifest: Mapping[str, Any], colour: bool | None = None, width: int = 120) -> str:
    """The summary as fixed-width plain text; colour only when asked or stdout is a TTY."""
    colour = _use_colour(sys.stdout) if colour is None else colour

    def paint(text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if colour else text

    out = [paint(_clean(title(manifest)), "1"), "=" * min(width, 100)]
    label_w = 12
    for sec in sections(manifest):
        status = _clean(sec.status) if sec.status else ""
        if status:
            code = "32" if status.startswith("bit-exact") else "31" if status.startswith(("diverged", "failed")) else \
                "2" if status in (NOT_MEASURED,) or status.startswith("skipped") else "0"
            status = paint(status, code)
        out.append(f"{paint(sec.title.ljust(label_w), '1')}{status}".rstrip())
        if sec.rows:
            key_w = min(34, max(len(_clean(k)) for k, _ in sec.rows))
            for k, v in sec.rows:
                out.append(_fit_width(f"{'':{label_w}}{_clean(k):<{key_w}}  {_clean(v)}".rstrip(), width))
        for grid in sec.grids:
            cells = [[_clean(c) for c in row] for row in grid.rows]
            widths = [min(48, max(len(h), *(len(r[i]) for r in cells))) for i, h in enumerate(grid.headers)]
            cells = [[c if len(c) <= w else c[: w - 1] + "…" for c, w in zip(row, widths)] for row in cells]
            line = lambda row: ("".ljust(label_w) + "  ".join(c.ljust(w) for c, w in zip(row, widths))).rstrip()  # noqa: E731
            out.append(_fit_width(line(grid.headers), width))
            out.append(_fit_width(line(["-" * w for w in widths]), width))
            out.extend(_fit_width(line(r), width) for r in cells)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- HTML

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:64em;color:#1d232a;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.1em;margin:1.6em 0 .3em;border-bottom:1px solid #ccd}
p.status{margin:.2em 0 .6em;font-weight:600}.ok{color:#17692d}.bad{color:#a4161a}.none{color:#778}
table{border-collapse:collapse;margin:.4em 0}td,th{padding:.15em .9em .15em 0;text-align:left;vertical-align:top}
th{font-weight:600;border-bottom:1px solid #ccd}td.k{color:#556}code{font-size:.95em}
svg{display:block;margin:.5em 0;max-width:100%;height:auto}svg text{font:11px system-ui,sans-serif;fill:#333}
"""

_TERM_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _status_class(status: str) -> str:
    if status.startswith("bit-exact"):
        return "ok"
    if status.startswith(("diverged", "failed")):
        return "bad"
    if status == NOT_MEASURED or status.startswith("skipped"):
        return "none"
    return ""


def _nice_ticks(top: float, count: int = 5) -> list[float]:
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
    ticks = _nice_ticks(ymax)
    ymax = max(ymax, ticks[-1])
    x = lambda i: left + (pw * (i + 0.5) / len(times))  # noqa: E731
    y = lambda v: top + ph - ph * v / ymax  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
             f'role="img" aria-label="step time per step">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafbfc" stroke="#ccd"/>']
    for t in ticks:
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#e4e6ea"/>'
                     f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{_e(fmt_seconds(t))}</text>')
    if warm:
        parts.append(f'<rect x="{left}" y="{top}" width="{x(warm - 1) - left + pw / len(times) / 2:.1f}" height="{ph}" '
                     f'fill="#eee"/><text x="{left + 4}" y="{top + ph - 6}">warm-up (excluded)</text>')
    pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(times) if i >= warm)
    if pts:
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#4e79a7" stroke-width="1.5"/>')
    for i, v in enumerate(times):
        fill = "#aab" if i < warm else "#4e79a7"
        tip = f"<title>step {i + 1}: {_e(fmt_seconds(v))}</title>"
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
                         f'{key} {_e(fmt_seconds(s[key]))}</text>')
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
    caps = [(str(_first(c, "name", "card", "model") or "?"), _card_capacity(c)) for c in fit_cards(m)]
    dev = _get(m, "accelerator.memory_per_device_bytes")
    if not (_is_num(dev) and dev > 0):
        dev = meas.get("device_total_bytes")
    if _is_num(dev) and dev > 0:
        caps.append(("this device", float(dev)))
    merged: dict[float, list[str]] = {}
    for name, cap in caps:
        if cap:
            merged.setdefault(cap, []).append(name)
    caps = [(" = ".join(names), cap) for cap, names in sorted(merged.items())]
    largest_bar = max(sum(v for _, v in parts) for _, parts in bars)
    on_scale = [(n, c) for n, c in caps if c <= 4 * largest_bar]
    off_scale = [(n, c) for n, c in caps if c > 4 * largest_bar]
    xmax = max([largest_bar] + [c for _, c in on_scale]) * 1.08 or 1.0
    w, left, right, bar_h, gap, top = 720, 110, 80, 22, 10, 24  # right: room for the bar's value
    pw = w - left - right
    legend_rows = (len(terms) + 2) // 3
    off_lines = [off_scale[i:i + 3] for i in range(0, len(off_scale), 3)]
    h = top + len(bars) * (bar_h + gap) + 12 * max(1, min(3, len(on_scale))) + 24 + 14 * (legend_rows + len(off_lines) + bool(off_lines))
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
                       f'fill="{colour}"><title>{_e(name)}: {_e(fmt_bytes(v))}</title></rect>')
            acc += v
        out.append(f'<text x="{x(acc) + 4:.1f}" y="{yy + bar_h * 0.7:.1f}">{_e(fmt_bytes(acc))}</text>')
    base = top + len(bars) * (bar_h + gap)
    for i, (name, cap) in enumerate(on_scale):
        out.append(f'<line x1="{x(cap):.1f}" x2="{x(cap):.1f}" y1="{top - 6}" y2="{base}" stroke="#a4161a" '
                   f'stroke-dasharray="4,3"/><text x="{x(cap) - 3:.1f}" y="{base + 12 + 12 * (i % 3)}" '
                   f'text-anchor="end" fill="#a4161a">{_e(name)} {_e(fmt_bytes(cap))}</text>')
    ly = base + 12 * max(1, min(3, len(on_scale))) + 20
    for i, (name, _) in enumerate(terms):
        lx = left + (i % 3) * 190
        yy = ly + 14 * (i // 3)
        out.append(f'<rect x="{lx}" y="{yy - 9}" width="10" height="10" fill="{colour_of[name]}"/>'
                   f'<text x="{lx + 14}" y="{yy}">{_e(name)}</text>')
    if off_lines:
        out.append(f'<text x="{left}" y="{ly + 14 * legend_rows + 4}" fill="#a4161a">capacities off scale '
                   f'(more than 4x the largest bar):</text>')
        for i, chunk in enumerate(off_lines):
            names = ", ".join(f"{n} {fmt_bytes(c)}" for n, c in chunk)
            out.append(f'<text x="{left + 12}" y="{ly + 14 * (legend_rows + i + 1) + 4}" fill="#a4161a">{_e(names)}</text>')
    out.append("</svg>")
    return "".join(out)


def render_html(manifest: Mapping[str, Any]) -> str:
    """One self-contained page: inline CSS and SVG, no scripts, no external assets."""
    body = [f"<h1>{_e(title(manifest))}</h1>"]
    for sec in sections(manifest):
        body.append(f"<h2>{_e(sec.title)}</h2>")
        if sec.status:
            body.append(f'<p class="status {_status_class(sec.status)}">{_e(sec.status)}</p>')
        if sec.title == "Steps":
            body.append(step_time_svg(manifest))
        if sec.title == "Memory":
            body.append(memory_svg(manifest))
        if sec.rows:
            body.append("<table>" + "".join(f'<tr><td class="k">{_e(k.strip())}</td><td>{_e(v)}</td></tr>'
                                            for k, v in sec.rows) + "</table>")
        for grid in sec.grids:
            body.append("<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in grid.headers) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in grid.rows)
                        + "</table>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{_e(title(manifest))}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_html(manifest: Mapping[str, Any], path: Path) -> Path:
    """Write the HTML report atomically to ``path`` (by convention next to the manifest)."""
    path = Path(path)
    atomic_write(path, render_html(manifest).encode("utf-8"))
    return path


def html_path_for(manifest_path: Path) -> Path:
    """``results/run.toml`` → ``results/run.html``."""
    return Path(manifest_path).with_suffix(".html")

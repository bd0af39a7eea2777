"""The report's content, shared by the terminal and HTML renderers: one :class:`Section` per stage."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capture.fmt import bytes_str, seconds_str
from capture.manifest import dig
from capture.trial.report.settings import TRAINING_KEYS, training_rows
from capture.trial.report.throughput import KEYS as MFU_KEYS, mfu_rows
from capture.trial.report.values import (NOT_MEASURED, _first, _is_num, _label, _numbers, _table, fmt_value,
                                         percentile)

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
    """Every key not shown otherwise, formatted by its unit (arrays of tables are left to grids);
    a sub-table of more than two entries is a row of its own per entry (:func:`_sub_rows`), not one
    ``k=v, k=v`` line."""
    if not table:
        return []
    rows: list[tuple[str, str]] = []
    for k, v in table.items():
        if k in known or (isinstance(v, list) and v and isinstance(v[0], Mapping)):
            continue
        if isinstance(v, Mapping) and len(v) > 2:
            rows.append((_label(k), ""))
            rows += _sub_rows(v)
        else:
            rows.append((_label(k), _inline(v) if isinstance(v, Mapping) else fmt_value(k, v)))
    return rows


def _inline(table: Mapping[str, Any]) -> str:
    """A small sub-table on its row: ``every steps 50 · batches 4``."""
    return " · ".join(f"{_key_label(k)} {_cell(k, v)}" for k, v in table.items()) or "-"


def _key_label(key: Any) -> str:
    """A key as a label; an environment variable's name (``PYTORCH_CUDA_ALLOC_CONF``) as written."""
    key = str(key)
    return key if key.isupper() else _label(key)


def _cell(key: Any, v: Any) -> str:
    return "(empty)" if v == "" else fmt_value(str(key), v)


def _sub_rows(table: Mapping[str, Any], indent: str = "  ") -> list[tuple[str, str]]:
    """A sub-table's entries, indented under its row; deeper tables indented again."""
    rows: list[tuple[str, str]] = []
    for k, v in table.items():
        if isinstance(v, Mapping) and len(v) > 2 and len(indent) < 6:
            rows.append((f"{indent}{_key_label(k)}", ""))
            rows += _sub_rows(v, indent + "  ")
        else:
            rows.append((f"{indent}{_key_label(k)}", _cell(k, v)))
    return rows


def _skipped(table: Mapping[str, Any] | None) -> str | None:
    if table and isinstance(table.get("skipped"), str):
        return f"skipped: {table['skipped']}"
    return None


def opened(m: Mapping[str, Any], title: str, dotted: str) -> tuple[Section, Mapping[str, Any] | None]:
    """A section and the manifest table it shows: the status is "not measured" where the table is
    missing (``None`` comes back), else the stage's skip reason, if any."""
    table = _table(m, dotted)
    sec = Section(title)
    sec.status = _skipped(table) if table else NOT_MEASURED
    return sec, table or None


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
    sec, run = opened(m, "Run", "trial.run")
    if run is None:
        return sec
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
                                                  f"weights {fmt_value('weights_dtype', prec['weights_dtype'])}" if prec.get("weights_dtype") else "",
                                                  "grad scaler" if prec.get("grad_scaler") else ""])), "precision")
    batch = [f"{label} {run[k]:,}" for k, label in (("max_seq_len", "seq"), ("micro_batch_size", "micro-batch"),
                                                   ("grad_accum", "grad-accum"), ("tokens_per_step", "tokens/step"))
             if _is_num(run.get(k))]
    row("batch", " · ".join(batch), "max_seq_len", "micro_batch_size", "grad_accum", "tokens_per_step")
    data = run.get("data")
    row("data", _summary(data, "name", "repo_id", "path", "source", "tokenizer", "train_tokens"), "data")
    if _is_num(run.get("measured_steps")):
        row("steps", f"{run.get('warmup_steps', 0)} warm-up + {run['measured_steps']} measured", "warmup_steps", "measured_steps")
    for label, text in training_rows(run):
        row(label, text)
    training = run.get("training")
    if isinstance(training, Mapping):  # what a newer trial records beside the settings shown above
        shown.add("training")
        sec.rows += _generic_rows({k: v for k, v in training.items() if k not in TRAINING_KEYS})
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
    sec.rows.append(("estimate", bytes_str(total) if total is not None else NOT_MEASURED))
    if est:
        for k, v in est.items():
            if isinstance(v, Mapping) and _is_num(v.get("bytes")):
                formula = f"  ({v['formula']})" if v.get("formula") else ""
                sec.rows.append((f"  {k.replace('_', ' ')}", bytes_str(v["bytes"]) + formula))
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
            sec.rows.append((f"measured {label}", bytes_str(v)))
        sec.rows += [(f"  {a}", b) for a, b in _generic_rows(meas, {k for keys in _MEASURED_KEYS for k in keys})]
    else:
        sec.rows.append(("measured", NOT_MEASURED))
    terms = mem.get("terms")
    grid = _terms_grid(terms) if isinstance(terms, Mapping) else None
    if grid is not None:
        sec.grids.append(grid)
    sec.rows += _generic_rows(mem, {"estimate", "measured", "skipped"} | ({"terms"} if grid is not None else set()))
    err = mem.get("estimate_error")
    if total is not None and ref is not None and ref[1] > 0:
        if not _is_num(err):
            err = (total - ref[1]) / ref[1]
        sec.status = f"estimate {bytes_str(total)} vs measured {bytes_str(ref[1])} {ref[0]} (error {err * 100:+.1f} %)"
    return sec


_TERM_KEYS = frozenset({"measured_bytes", "state_bytes", "estimate_bytes", "error", "miss_bytes", "basis"})


def _terms_grid(terms: Mapping[str, Any]) -> Grid | None:
    """Each term measured on its own (weights as built, the optimizer's state, the allocator's
    peak and reserve) beside its estimate: one row a term, what else it recorded in its note."""
    rows = []
    for name, t in terms.items():
        if not isinstance(t, Mapping):
            continue
        measured = t.get("measured_bytes", t.get("state_bytes"))
        est, err = t.get("estimate_bytes"), t.get("error")
        if not _is_num(err) and _is_num(measured) and _is_num(est) and measured:
            err = (est - measured) / measured
        extra = "; ".join(f"{_label(k)} {fmt_value(k, v)}" for k, v in t.items() if k not in _TERM_KEYS)
        note = "; ".join(x for x in (str(t["basis"]) if t.get("basis") else "", extra) if x)
        rows.append([name.replace("_", " "), bytes_str(measured) if _is_num(measured) else "-",
                     bytes_str(est) if _is_num(est) else "-", f"{err * 100:+.1f} %" if _is_num(err) else "-", note])
    return Grid(["term measured alone", "measured", "estimate", "error", "how measured"], rows) if rows else None


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
    sec.status = f"median {seconds_str(s['median'])}, p90 {seconds_str(s['p90'])}" + (
        f", CV {s['cv'] * 100:.2f} %" if "cv" in s else "")
    if times:
        sec.rows.append(("steps", f"{len(times) - warm} measured after {warm} warm-up"))
    waits = _numbers((steps or {}).get("data_wait_s"))
    if waits and times:
        total = sum(times[warm:])
        sec.rows.append(("data wait", f"{seconds_str(sum(waits))} in total, max {seconds_str(max(waits))}"
                         + (f" ({sum(waits) / total * 100:.2f} % of step time)" if total > 0 else "")))
    losses = _numbers((steps or {}).get("loss"))
    if losses:
        sec.rows.append(("loss", f"{losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps"))
    mfu = mfu_rows(stats or {})
    sec.rows += mfu
    sec.rows += _generic_rows(stats, {"step_time_median_s", "step_time_p90_s", "step_time_cv", "skipped"}
                              | (MFU_KEYS if mfu else set()))
    return sec


def _simple_section(m: Mapping[str, Any], title: str, dotted: str) -> Section:
    sec, table = opened(m, title, dotted)
    if table is None:
        return sec
    sec.rows = _generic_rows(table, {"skipped", "phases"})
    return sec


def _cost_section(m: Mapping[str, Any], cost: Any = None) -> Section:
    """The three cost figures (:mod:`capture.costs`), the projection as a table, the trial's phases.
    ``cost``: the figures a caller computed (the decision site, at its price and target)."""
    from capture import costs

    sec, table = opened(m, "Cost", "trial.cost")
    if table is None:
        return sec
    fig = cost if cost is not None else costs.figures(m)
    sec.status = _skipped(table) or fig.trial_text()
    sec.rows = fig.texts(note=fig.note is None or fig.note not in sec.status)
    if fig.price is not None:
        sec.rows.append(("price", f"{fig.price.per_device_hour:g} {fig.currency} per device-hour ({fig.price.source})"))
    own = dig(m, "trial.cost.projection.target_tokens")
    if _is_num(own) and own != fig.target.tokens:
        proj = costs.figures(m, price=fig.price, currency=fig.currency,
                             target=costs.Target(int(own), str(dig(m, "trial.cost.projection.target_source") or "recorded")))
        sec.rows.append(("also, to the trial's own target", proj.projected_text()))
    sec.rows += _generic_rows(table, {"skipped", "phases", "projection", "price_per_hour", "price_source", "trial_cost",
                                      "cost_per_million_trained_tokens", "currency", "price_note"})
    rows = fig.projection_rows()
    if rows:
        sec.grids.append(Grid([f"projection to {fig.target.text()}", "time", f"cost ({fig.currency})"], rows))
    phases = table.get("phases")
    if isinstance(phases, Mapping) and phases:
        wall = table.get("wall_total_s")
        rows = [[_label(k), fmt_value(k, v), f"{v / wall * 100:.1f} %" if _is_num(v) and _is_num(wall) and wall else ""]
                for k, v in phases.items()]
        sec.grids.append(Grid(["phase of the trial", "wall time", "share"], rows))
    return sec


def fit_cards(m: Mapping[str, Any]) -> list[dict[str, Any]]:
    fit = dig(m, "trial.fit")
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
        # the search's own headline says "capped at N" when it stopped at --max-batch, which a bare
        # "largest micro-batch N" would misstate as a real limit
        headline = search.get("headline")
        sec.rows.append(("max-batch search", str(headline)) if headline else
                        ("largest micro-batch", fmt_value("", search.get("max_micro_batch", "?"))))
        sec.rows += [(f"  {a}", b) for a, b in _generic_rows(search, {"max_micro_batch", "headline"})]
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
               bytes_str(cap) if cap is not None else "?",
               (bytes_str(head) if _is_num(head) else "?") + (f" ({frac * 100:.1f} %)" if _is_num(frac) else ""),
               bytes_str(margin) if _is_num(margin) else "",
               ("yes" if fits else "no") if isinstance(fits, bool) else "?",
               "yes" if c.get("tested") is True else "no" if c.get("tested") is False else "?"]
        if not shared_basis:
            row.append(str(c.get("basis", "")))
        rows.append(row)
    headers = ["card", "memory", "free after run", "margin to headroom", "fits", "tested"]
    sec.grids.append(Grid(headers + ([] if shared_basis else ["basis"]), rows))
    return sec


_RECOVERY_KNOWN = {
    "verdict", "save_at_step", "total_steps", "fresh_process", "withheld", "loss_diff", "diverged_at_step",
    "restore_repeat", "deterministic_algorithms", "max_abs_param_diff", "param_hash_resumed", "param_hash_uninterrupted",
    "checkpoint_size_bytes", "checkpoint_write_s", "restore_load_s", "sensitivity_control", "elapsed_s", "sensitivity",
    "losses_uninterrupted", "losses_resumed", "skipped", "optimizer_hash_resumed", "optimizer_hash_uninterrupted",
    "components_saved", "base_model", "resume_again", "data_order", "phases", "restored_state",
}
_RECOVERY_PHASES = ("reference", "save", "worker_start", "restore_build", "base_verify", "restore", "continuations",
                    "second_resume", "sensitivity", "total")


def _recovery_section(m: Mapping[str, Any]) -> Section:
    sec, rec = opened(m, "Recovery", "trial.recovery")
    if rec is None or sec.status:
        return sec
    verdict = str(rec.get("verdict") or NOT_MEASURED)
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
    if rec.get("optimizer_hash_uninterrupted"):
        same_opt = rec.get("optimizer_hash_resumed") == rec.get("optimizer_hash_uninterrupted")
        sec.rows.append(("optimizer hash", ("equal " if same_opt else "differs ") + str(rec["optimizer_hash_uninterrupted"])[:23] + "…"))
    saved = rec.get("components_saved")
    if isinstance(saved, list) and saved:
        sec.rows.append(("saved", ", ".join(map(str, saved))))
    sec.rows += _resume_rows(rec)
    for key in ("checkpoint_size_bytes", "checkpoint_write_s", "restore_load_s", "sensitivity_control", "elapsed_s"):
        if rec.get(key) is not None:
            sec.rows.append((_label(key), fmt_value(key, rec[key])))
    extra_rows, extra_grids = recovery_extras(rec, _RECOVERY_KNOWN)
    sec.rows += extra_rows
    sec.grids += extra_grids
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


def _resume_rows(rec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The base, the second resume, the data order and the phase table, one line each."""
    rows: list[tuple[str, str]] = []
    b = rec.get("base_model")
    if isinstance(b, Mapping):
        bad = b.get("mismatched_files") or []
        rows.append(("base model", f"{'verified' if b.get('equal') else 'DIFFERS'} ({b.get('kind')}"
                     + (f": {', '.join(map(str, bad))}" if bad else "") + "), not in the checkpoint"))
    again = rec.get("resume_again")
    if isinstance(again, Mapping):
        rows.append(("second resume", _skipped(again) or f"{again.get('verdict')} (from the checkpoint the first "
                     f"resume wrote after step {again.get('save_at_step')}; {again.get('restored_state_verdict')})"))
    order = rec.get("data_order")
    if isinstance(order, Mapping) and order.get("verdict"):
        rows.append(("data order", str(order["verdict"])))
    phases = rec.get("phases")
    if isinstance(phases, Mapping):
        overlapped = set(phases.get("overlapped") or ())
        parts = [f"{name.replace('_', ' ')} {fmt_value('x_s', phases[name + '_s'])}"
                 + (" (overlapped)" if name in overlapped else "")
                 for name in _RECOVERY_PHASES if _is_num(phases.get(name + "_s"))]
        rows.append(("phases", " · ".join(parts)))
    restored = [r for r in rec.get("restored_state") or [] if isinstance(r, Mapping)]
    if restored:
        differs = [f"{r.get('component')}" + (f" ({r['note']})" if r.get("note") else "") for r in restored
                   if not r.get("equal")]
        rows.append(("restored state", "differs: " + "; ".join(differs) if differs else
                     "equal to what was saved: " + ", ".join(str(r.get("component")) for r in restored)))
    return rows


def recovery_extras(rec: Mapping[str, Any], known: set[str]) -> tuple[list[tuple[str, str]], list[Grid]]:
    """What a newer recovery stage adds that the layout does not know: verdict strings first,
    arrays of tables as tables, sub-tables as rows."""
    rows: list[tuple[str, str]] = []
    grids: list[Grid] = []
    for k, v in rec.items():
        if k in known:
            continue
        if isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            heads: list[str] = []
            for x in v:
                heads += [h for h in x if h not in heads and not isinstance(x[h], (Mapping, list))]
            grids.append(Grid([f"{k.replace('_', ' ')}: {h.replace('_', ' ')}" if i == 0 else h.replace("_", " ")
                               for i, h in enumerate(heads)],
                              [[fmt_value(h, x.get(h)) if x.get(h) is not None else "" for h in heads] for x in v]))
        elif isinstance(v, Mapping):
            verdict = _first(v, "verdict")
            rest = {a: b for a, b in v.items() if a != "verdict"}
            head = str(verdict).upper() if verdict else ""
            if len(rest) > 2:
                rows.append((_label(k), head))
                rows += _sub_rows(rest)
            else:
                rows.append((_label(k), " · ".join(filter(None, [head, _inline(rest) if rest else ""]))))
        elif "verdict" in k:
            rows.insert(0, (k.replace("_", " ").upper(), str(v)))
        else:
            rows.append((_label(k), fmt_value(k, v)))
    return rows, grids



def title(m: Mapping[str, Any]) -> str:
    name = dig(m, "trial.run.name") or dig(m, "trial.name")
    when = m.get("created_utc") if isinstance(m, Mapping) else None
    return "capture trial report" + (f": {name}" if name else "") + (f" ({when})" if when else "")


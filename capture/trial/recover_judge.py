"""Judging the recovery check: resumed runs against the uninterrupted one, and the tables that say so.

Used by capture.trial.recover (the stage) and the scaling step's restore (compare_run, verdict_text).
Layout of the tables: docs/trial.md#recovery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from capture.trial import data_order
from capture.trial.state import COMPONENTS

BIT_EXACT = "bit-exact"
BAND_MARGIN = 10.0
"""A difference is inside the run-to-run band when at most BAND_MARGIN × the band (the band is
measured from two or three continuations only, so it is a low estimate of the spread)."""


def first_divergence(reference: Sequence[float], resumed: Sequence[float], first_step: int) -> tuple[int | None, float]:
    """(1-based global step of the first loss that differs, resumed − reference there)."""
    for i, (a, b) in enumerate(zip(reference, resumed)):
        if a != b and not (math.isnan(a) and math.isnan(b)):
            return first_step + i, b - a
    return None, 0.0


def compare_run(reference_losses: Sequence[float], reference_hashes: tuple[str, str], losses: Sequence[float],
                hashes: tuple[str, str], save_at_step: int) -> tuple[int | None, float, bool]:
    """(diverged_at_step or None, loss_diff, every loss equal) of a resumed run against the reference.

    ``reference_losses`` covers the steps after ``save_at_step``. Equal losses with a different
    final state count as a divergence at the last step.
    """
    step, diff = first_divergence(reference_losses, losses, save_at_step + 1)
    losses_equal = step is None and len(losses) == len(reference_losses)
    if step is None and (not losses_equal or hashes != reference_hashes):
        step = save_at_step + len(reference_losses)
    return step, diff, losses_equal


def verdict_text(diverged_at_step: int | None, losses_equal: bool) -> str:
    if diverged_at_step is None:
        return BIT_EXACT
    if losses_equal:
        return f"diverged at step {diverged_at_step} (final state differs; every loss equal)"
    return f"diverged at step {diverged_at_step}"


def max_loss_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest |a_i − b_i| over the steps both ran (inf when one is NaN and the other not)."""
    worst = 0.0
    for x, y in zip(a, b):
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return math.inf
            continue
        worst = max(worst, abs(x - y))
    return worst


def run_to_run_band(continuations: Sequence[Mapping[str, Any]]) -> float:
    """The largest loss difference between any two continuations from the same restored state."""
    return max((max_loss_diff(a["losses"], b["losses"]) for i, a in enumerate(continuations)
                for b in continuations[i + 1:]), default=0.0)


def judge(reference_losses: Sequence[float], reference_hashes: tuple[str, str], run: Mapping[str, Any],
          band: float, k: int) -> dict[str, Any]:
    """One continuation against the reference: kind (bit-exact | within_band | beyond_band), step, sizes."""
    step, diff, losses_equal = compare_run(reference_losses, reference_hashes, run["losses"],
                                           (run["param_hash"], run["optimizer_hash"]), k)
    size = max_loss_diff(reference_losses, run["losses"])
    out: dict[str, Any] = {"loss_diff": diff, "loss_diff_max": size}
    if step is None:
        out.update(kind="bit-exact", text=BIT_EXACT)
        return out
    out["diverged_at_step"] = step
    if band > 0 and size <= BAND_MARGIN * band:
        out.update(kind="within_band", text=f"equal within the run-to-run band (max |Δloss| {size:.3g}, "
                                            f"band {band:.3g}, margin {BAND_MARGIN:g}×)")
    elif band > 0:
        out.update(kind="beyond_band", text=f"diverged beyond the run-to-run band at step {step} "
                                            f"(max |Δloss| {size:.3g}, band {band:.3g})")
    else:
        out.update(kind="beyond_band", text=verdict_text(step, losses_equal))
        if losses_equal:
            out["note"] = "every loss equal; the final parameters or optimizer state differ"
    return out


# --------------------------------------------------------------------------- tables


def reference_table(ref: Any, withhold: Sequence[str], leave_out: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "reference_fresh_process": ref.fresh_process,
        "losses_uninterrupted": ref.losses,
        "param_hash_uninterrupted": ref.param_hash,
        "optimizer_hash_uninterrupted": ref.optimizer_hash,
        "checkpoint_size_bytes": ref.saved["size_bytes"],
        "checkpoint_write_s": ref.saved["durable_s"],
        "checkpoint_blocked_s": ref.saved["blocked_s"],
        "checkpoint_contents": ref.contents,
        "components_saved": [c for c in COMPONENTS if ref.applicability[c] is None and c not in leave_out],
        "step_time_s": ref.step_time_s,
    }
    if len(ref.step_time_s) > 1:
        after_first = sorted(ref.step_time_s[1:])
        out["step_time_median_s"] = after_first[len(after_first) // 2]
        out["step_time_basis"] = "the reference's steps after its first, each waited for (loss.item())"
    if leave_out:
        out["left_out_of_checkpoint"] = list(leave_out)
    not_applicable = [c for c in withhold if ref.applicability[c] is not None]
    if not_applicable:
        out["withheld_not_applicable"] = not_applicable
    return out


def state_rows(ref: Any, saved: Mapping[str, str], restored: Mapping[str, str], missing: Sequence[str],
               withhold: Sequence[str]) -> list[dict[str, Any]]:
    """One row per applicable component: restored equals saved (hashed before any step)?"""
    rows = []
    for c in COMPONENTS:
        if ref.applicability[c] is not None:
            continue
        s, r = saved.get(c), restored.get(c)
        row: dict[str, Any] = {"component": c, "equal": s is not None and s == r, "saved_sha256": s or "",
                               "restored_sha256": r or ""}
        if c in withhold:
            row["note"] = "withheld on purpose"
        elif c in missing:
            row["note"] = "not in the checkpoint: left as freshly built"
        rows.append(row)
    return rows


def state_verdict(rows: Sequence[Mapping[str, Any]], withhold: Sequence[str]) -> tuple[str, list[str]]:
    """(the restored-state verdict, the components that differ without being withheld on purpose)."""
    equal = sum(bool(r["equal"]) for r in rows)
    text = (f"all {len(rows)} components equal to what was saved" if equal == len(rows) else
            f"{equal} of {len(rows)} equal; differs: " + ", ".join(r["component"] for r in rows if not r["equal"]))
    return text, [r["component"] for r in rows if not r["equal"] and r["component"] not in withhold]


def restore_table(ref: Any, result: Mapping[str, Any], withhold: Sequence[str], k: int,
                  base_row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"restore_load_s": result["restore_load_s"]}
    if result.get("timings"):
        out["restore_timings"] = {name: float(v) for name, v in result["timings"].items()}
    rows = state_rows(ref, ref.saved_hashes, result["restored_hashes"], result.get("missing", []), withhold)
    if base_row is not None:
        rows.insert(0, dict(base_row))
    out["restored_state"] = rows
    out["restored_state_verdict"], unexpected = state_verdict(rows, withhold)
    if unexpected:
        out["verdict"] = (f"restored state differs from the saved state: {', '.join(unexpected)} "
                          "(caught before any step ran)")
        out["verdict_kind"] = "state_differs"
        return out
    runs = result["continuations"]
    band = run_to_run_band(runs)
    main = runs[0]
    j = judge(ref.losses[k:], ref.hashes, main, band, k)
    out.update(verdict=j["text"], verdict_kind=j["kind"], loss_diff=j["loss_diff"], loss_diff_max=j["loss_diff_max"],
               run_to_run_band=band, run_to_run_runs=len(runs), band_margin=BAND_MARGIN,
               losses_resumed=main["losses"], param_hash_resumed=main["param_hash"],
               optimizer_hash_resumed=main["optimizer_hash"])
    if "diverged_at_step" in j:
        out["diverged_at_step"] = j["diverged_at_step"]
    out["restore_repeat"] = "identical" if band == 0 and all(
        (r["param_hash"], r["optimizer_hash"]) == (main["param_hash"], main["optimizer_hash"]) for r in runs) else (
        f"differs from the first restore (max |Δloss| {band:.3g}): the step is not deterministic on this stack")
    if "sensitivity" in result:
        out["sensitivity_rule"] = (f"depends: withholding it moves the losses by more than {BAND_MARGIN:g} × the "
                                   f"run-to-run band ({band:.3g})" if band > 0 else
                                   "depends: withholding it changes any loss or the final state (the band is 0)")
        out["sensitivity"] = sensitivity_rows(ref, result["sensitivity"], band, k)
    return out


def sensitivity_rows(ref: Any, variants: Mapping[str, Mapping[str, Any]], band: float, k: int) -> list[dict[str, Any]]:
    entries = []
    for c in COMPONENTS:
        reason = ref.applicability[c]
        entry: dict[str, Any] = {"component": c, "applicable": reason is None}
        variant = variants.get(c)
        if reason is not None:
            entry["note"] = reason
        elif variant is None:
            entry["note"] = "not run"
        elif "error" in variant:
            entry["note"] = f"failed: {variant['error']}"
        elif variant.get("undrawn"):
            entry.update(depends=False, loss_diff=0.0, loss_diff_max=0.0,
                         note="not drawn from during the continuation: withholding it cannot change the run "
                              "(no restore needed)")
        else:
            j = judge(ref.losses[k:], ref.hashes, variant, band, k)
            entry.update(depends=j["kind"] == "beyond_band", loss_diff=j["loss_diff"], loss_diff_max=j["loss_diff_max"])
            if "diverged_at_step" in j and j["kind"] == "beyond_band":
                entry["diverged_at_step"] = j["diverged_at_step"]
            if j["kind"] == "within_band":
                entry["note"] = f"moved the losses by {j['loss_diff_max']:.3g}: inside the run-to-run band"
            elif "note" in j:
                entry["note"] = j["note"]
        entries.append(entry)
    return entries


def resume_again_table(ref: Any, saved_again: Mapping[str, Any], result: Mapping[str, Any], k2: int,
                       band: float) -> dict[str, Any]:
    """``[trial.recovery.resume_again]``: the checkpoint the first resumed run wrote at step k2,
    restored in another fresh process and continued."""
    out: dict[str, Any] = {"save_at_step": k2, "checkpoint_size_bytes": saved_again["size_bytes"],
                           "checkpoint_write_s": saved_again["durable_s"],
                           "written_by": "the first resumed process (as a resumed run writes its next checkpoint)",
                           "restore_load_s": result["restore_load_s"]}
    rows = state_rows(ref, saved_again["hashes"], result["restored_hashes"], result.get("missing", []), ())
    out["restored_state"] = rows
    out["restored_state_verdict"], unexpected = state_verdict(rows, ())
    if unexpected:
        out.update(verdict=f"restored state differs from the saved state: {', '.join(unexpected)} "
                           "(caught before any step ran)", verdict_kind="state_differs")
        return out
    run = result["continuation"]
    j = judge(ref.losses[k2:], ref.hashes, run, band, k2)
    out.update(verdict=j["text"], verdict_kind=j["kind"], loss_diff=j["loss_diff"], loss_diff_max=j["loss_diff_max"],
               losses_resumed=run["losses"], param_hash_resumed=run["param_hash"],
               optimizer_hash_resumed=run["optimizer_hash"])
    if "diverged_at_step" in j:
        out["diverged_at_step"] = j["diverged_at_step"]
    return out


def overall(table: dict[str, Any], again: Mapping[str, Any] | None, order: Mapping[str, Any] | None) -> None:
    """Fold the second resume and the data order into the headline ``verdict``/``verdict_kind``:
    the first thing that went wrong, named by where it happened."""
    if table.get("verdict_kind") not in ("bit-exact", "within_band"):
        pass
    elif again is not None and again.get("verdict_kind") == "state_differs":
        table.update(verdict=f"second resume (from step {again['save_at_step']}): {again['verdict']}",
                     verdict_kind="state_differs")
    elif again is not None and again.get("verdict_kind") == "beyond_band":
        table.update(verdict=f"second resume (from step {again['save_at_step']}): {again['verdict']}",
                     verdict_kind="beyond_band", diverged_at_step=again.get("diverged_at_step"))
    if order is not None and not order.get("equal", True) and table.get("verdict_kind") != "state_differs":
        table.update(verdict=f"data order differs: {order['verdict']}", verdict_kind="data_order_differs")


def data_order_table(ref: Any, k: int, first: Mapping[str, Any] | None, k2: int | None,
                     second: Mapping[str, Any] | None) -> dict[str, Any]:
    return data_order.table(ref.batches, first.get("batches") if first else None, k,
                            second.get("batches") if second else None, k2, ref.boundary, ref.positions)

"""What the trial measured, set beside what was estimated: the ``[trial.memory]`` table term by
term, real and pad tokens, and model FLOPs utilisation both ways (6N, and with attention).

Per term, what can be measured is measured: the weights (allocated by the build), the optimizer
state (its tensors after the steps), the allocator's peak of allocated tensors, its reserve
beyond them (peak reserved - peak allocated) and the device's own figure (NVML/amdsmi, or the
peak RSS on a CPU). Each gets its error against the estimate's term, so a miss is named.
"""

from __future__ import annotations

import os
from typing import Any

from capture.trial.memory import relative_error

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
LARGE_RESERVE_SHARE = 0.05
"""A measured reserve beyond allocated above this share of the device figure gets the note on
``expandable_segments``."""


def _term(est: Any, name: str) -> int:
    t = est.term(name)
    return t.bytes if t is not None else 0


def memory_table(est: Any, reading: Any, overhead: int | None, weights_bytes: int | None, wl: Any) -> dict[str, Any]:
    measured = reading.to_manifest()
    out: dict[str, Any] = {"estimate": est.to_manifest(), "measured": measured}
    if overhead is not None:
        out["framework_overhead_bytes"] = overhead
    err = relative_error(est.total_bytes, reading.device_used_bytes)
    if err is not None:
        out["estimate_error"] = err
        out["estimate_error_basis"] = f"(estimate total - measured device use) / measured device use; measured: {reading.device_used_source}"
    if reading.peak_allocated_bytes:
        out["allocator_estimate_error"] = relative_error(est.allocator_bytes, reading.peak_allocated_bytes)
    terms: dict[str, Any] = {}
    if weights_bytes is not None:
        want = _term(est, "weights") + _term(est, "lora_adapters")
        terms["weights"] = {"measured_bytes": weights_bytes, "estimate_bytes": want,
                            "error": relative_error(want, weights_bytes),
                            "basis": "allocated by the build (device) / parameter, buffer and data tensors (CPU)"}
    if wl is not None:
        from capture.trial.build.optim import state_facts

        facts = state_facts(wl.optimizer)
        paged = _term(est, "optimizer_state_paged")
        want = _term(est, "optimizer_state") + paged
        terms["optimizer_state"] = dict(facts, estimate_bytes=want, error=relative_error(want, facts["state_bytes"]),
                                        basis="the optimizer's state tensors after the steps, each storage once")
        if paged or facts["paged_bytes"]:  # the unified-memory part on its own (NVML sees it, the allocator does not)
            terms["optimizer_state"]["paged_estimate_bytes"] = paged
    if reading.peak_allocated_bytes:
        terms["peak_allocated"] = {"measured_bytes": reading.peak_allocated_bytes, "estimate_bytes": est.allocator_bytes,
                                   "error": relative_error(est.allocator_bytes, reading.peak_allocated_bytes)}
    if reading.peak_allocated_bytes and reading.peak_reserved_bytes:
        gap = reading.peak_reserved_bytes - reading.peak_allocated_bytes
        want = _term(est, "allocator_reserve")
        terms["allocator_reserve"] = {"measured_bytes": gap, "estimate_bytes": want,
                                      "miss_bytes": want - gap,
                                      "basis": "peak reserved - peak allocated (the caching allocator's blocks beyond tensors)"}
    if terms:
        out["terms"] = terms
    conf = os.environ.get(ALLOC_CONF)
    out["allocator_settings"] = {ALLOC_CONF: conf or "", "expandable_segments": "expandable_segments:true" in (conf or "").lower().replace(" ", "")}
    used, gap = reading.device_used_bytes, None
    if reading.peak_allocated_bytes and reading.peak_reserved_bytes:
        gap = reading.peak_reserved_bytes - reading.peak_allocated_bytes
    if used and gap and gap > LARGE_RESERVE_SHARE * used and not out["allocator_settings"]["expandable_segments"] \
            and est.expandable_bytes is not None:
        saves = est.total_bytes - est.expandable_bytes
        out["reserve_note"] = (f"the caching allocator held {gap / 2**30:.2f} GiB beyond the peak of tensors "
                               f"({gap / used:.0%} of the device figure); with expandable_segments:True the estimate "
                               f"is {saves / 2**30:.2f} GiB lower: run the trial again with --expandable-segments "
                               "to measure it")
    return out


def token_accounting(trial: dict[str, Any], step_tokens: list[tuple[int, int]], warmup: int) -> None:
    """Real tokens are what throughput counts; pad tokens are counted beside them."""
    pads = [p for _, p in step_tokens[warmup:]]
    real = [t for t, _ in step_tokens[warmup:]]
    stats = trial.get("stats", {})
    if "skipped" in stats:
        return
    stats["pad_tokens_total"] = sum(pads)
    stats["pad_share"] = sum(pads) / (sum(pads) + sum(real)) if (sum(pads) + sum(real)) else 0.0
    stats["tokens_note"] = "tokens and tokens/s count real tokens; pad tokens are counted in pad_tokens_total"
    trial.setdefault("steps", {})["pad_tokens"] = [p for _, p in step_tokens]


def attention_flops_per_token(plan: Any) -> tuple[float, dict[str, Any]]:
    """Causal self-attention's score and value matmuls per trained token, forward and backward:
    6 x layers x attention width x seq (2 matmuls x 2 FLOPs x seq/2 positions on average, x 3)."""
    s = plan.shape
    flops = 6.0 * plan.layers * s.q_width * plan.seq
    return flops, {"layers": plan.layers, "attention_width": s.q_width, "seq_len": plan.seq}


def attention_mfu(stats: dict[str, Any], plan: Any, config: Any) -> None:
    """MFU both ways: the 6N figure the catalog peak is usually quoted against, and one that also
    counts causal attention's FLOPs (PaLM's 12 x L x H x Q x T counts the full score matrix;
    causal attention computes half of it)."""
    if "mfu" not in stats or not stats.get("flops_per_token") or not stats.get("peak_flops"):
        return
    att, inputs = attention_flops_per_token(plan)
    base = float(stats["flops_per_token"])
    stats["mfu_6n"] = stats["mfu"]
    stats["flops_formula_6n"] = stats.get("flops_formula")
    stats["flops_per_token_with_attention"] = base + att
    stats["mfu_with_attention"] = stats["mfu"] * (base + att) / base
    stats["attention_flops_per_token"] = att
    stats["attention_flops_formula"] = "6 x layers x attention_width x seq_len (causal: half the score matrix)"
    stats["attention_flops_inputs"] = inputs
